"""Named workloads: prompt sets defined in ``bench/workloads.json``, built into token ids.

Every prompt is a chat (the definitions' system prompt, then one user message) passed
through the tokenizer's chat template, so all systems see identical token ids. The kinds:

- ``file``: user messages from a text file, each introduced by a ``=== <n> | <topic>`` line;
- ``lines``: one user message per line;
- ``grid``: every template of a JSON file combined with every subject;
- ``long``: long documents stitched from the passages of a ``file`` source, each trimmed to
  a length spread evenly over ``[min_tokens, max_tokens]``, then a question;
- ``fewshot``: one instruction and worked examples shared by all prompts, then a question.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LONG_QUESTIONS = (
    "Summarize the document above in five bullet points.",
    "List the main topics covered in the document above.",
    "Which part of the document above is the most practical, and why?",
    "Write three quiz questions about the document above.",
)


def bench_dir() -> Path:
    """The folder holding ``workloads.json`` and the prompt files (``$CBGEN_BENCH_DIR``)."""
    override = os.environ.get("CBGEN_BENCH_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "bench"


def load_definitions(root: Path | None = None) -> dict[str, Any]:
    root = root or bench_dir()
    path = root / "workloads.json"
    if not path.exists():
        raise FileNotFoundError(
            f"no workload definitions at {path}: run from a cbgen checkout or set CBGEN_BENCH_DIR"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def workload_names(root: Path | None = None) -> list[str]:
    return list(load_definitions(root)["workloads"])


@dataclass
class Workload:
    """One named prompt set, tokenized, with its generation length."""

    name: str
    description: str
    prompts: list[list[int]]
    max_new_tokens: int
    messages: list[str] = field(default_factory=list, repr=False)
    quick: bool = False

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def num_output_tokens(self) -> int:
        return self.max_new_tokens * len(self.prompts)

    def summary(self) -> dict[str, Any]:
        lengths = self.prompt_lengths
        return {
            "name": self.name,
            "description": self.description,
            "quick": self.quick,
            "num_prompts": len(self.prompts),
            "max_new_tokens": self.max_new_tokens,
            "prompt_tokens": sum(lengths),
            "prompt_len_min": min(lengths),
            "prompt_len_mean": round(sum(lengths) / len(lengths), 1),
            "prompt_len_max": max(lengths),
            "output_tokens": self.num_output_tokens,
        }

    def to_json(self) -> dict[str, Any]:
        """What a worker (or a peer's runner) needs: the token ids and the length."""
        return {
            "name": self.name,
            "max_new_tokens": self.max_new_tokens,
            "prompts": self.prompts,
        }


# -- building ------------------------------------------------------------------------------


def build_workload(
    name: str,
    tokenizer: Any,
    *,
    quick: bool = False,
    num_prompts: int | None = None,
    max_new_tokens: int | None = None,
    root: Path | None = None,
) -> Workload:
    """Tokenize workload ``name``; ``quick`` applies its ``quick`` overrides, then the
    explicit ``num_prompts`` / ``max_new_tokens`` (if given) win."""
    root = root or bench_dir()
    definitions = load_definitions(root)
    known = definitions["workloads"]
    if name not in known:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(known)}")
    spec = dict(known[name])
    defined = (int(spec["num_prompts"]), int(spec["max_new_tokens"]))
    if quick:
        spec.update(spec.get("quick", {}))
    if num_prompts is not None:
        spec["num_prompts"] = num_prompts
    if max_new_tokens is not None:
        spec["max_new_tokens"] = max_new_tokens
    count = int(spec["num_prompts"])
    if count <= 0 or int(spec["max_new_tokens"]) <= 0:
        raise ValueError(f"workload {name!r}: num_prompts and max_new_tokens must be positive")
    system = definitions.get("system_prompt")

    def encode(message: str) -> list[int]:
        return chat_token_ids(tokenizer, message, system)

    kind = spec["kind"]
    source = root / spec["source"]
    if kind == "file":
        messages = read_sectioned_file(source)
    elif kind == "lines":
        messages = read_lines(source)
    elif kind == "grid":
        messages = grid_messages(source)
    elif kind == "fewshot":
        messages = fewshot_messages(source)
    elif kind == "long":
        messages = long_messages(
            read_sectioned_file(source),
            count,
            int(spec["min_tokens"]),
            int(spec["max_tokens"]),
            tokenizer,
            encode,
        )
    else:
        raise ValueError(f"workload {name!r}: unknown kind {kind!r}")
    if len(messages) < count:
        raise ValueError(f"workload {name!r} has {len(messages)} prompts, {count} were asked for")
    messages = spread(messages, count)
    description = spec.get("description", "")
    if (count, int(spec["max_new_tokens"])) != defined:
        # the definition's text names its own counts; say what this run uses instead
        description += (
            f" (as defined; run here with {count} prompts, {spec['max_new_tokens']} new tokens)"
        )
    return Workload(
        name=name,
        description=description,
        prompts=[encode(m) for m in messages],
        max_new_tokens=int(spec["max_new_tokens"]),
        messages=messages,
        quick=quick,
    )


def spread(items: list[Any], count: int) -> list[Any]:
    """``count`` items spaced evenly over ``items`` (all of them, in order, if count fits)."""
    if count >= len(items):
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


def chat_token_ids(tokenizer: Any, message: str, system: str | None = None) -> list[int]:
    """The prompt ids of one user message through the chat template (raw text without one)."""
    if getattr(tokenizer, "chat_template", None) is None:
        text = f"{system}\n\n{message}" if system else message
        return list(tokenizer(text)["input_ids"])
    conversation = [{"role": "user", "content": message}]
    if system:
        conversation.insert(0, {"role": "system", "content": system})
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


_SECTION = re.compile(r"^=== .*$", re.MULTILINE)


def read_sectioned_file(path: Path) -> list[str]:
    """Messages separated by ``=== ...`` lines; text before the first one is a comment."""
    text = path.read_text(encoding="utf-8")
    parts = _SECTION.split(text)[1:]
    return [part.strip() for part in parts if part.strip()]


def read_lines(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def grid_messages(path: Path) -> list[str]:
    """Every template with every subject; neighbours differ in both template and subject."""
    data = json.loads(path.read_text(encoding="utf-8"))
    templates, subjects = data["templates"], data["subjects"]
    count = len(templates) * len(subjects)
    messages = []
    for i in range(count):
        t = i % len(templates)
        s = (i // len(templates) + t) % len(subjects)
        messages.append(templates[t].format(subjects[s]))
    return messages


def fewshot_prefix(data: dict[str, Any]) -> str:
    shots = "".join(
        f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\n" for ex in data["examples"]
    )
    return f"{data['instruction']}\n\n{shots}"


def fewshot_messages(path: Path) -> list[str]:
    data = json.loads(path.read_text(encoding="utf-8"))
    prefix = fewshot_prefix(data)
    return [f"{prefix}Question: {q}\nAnswer:" for q in data["questions"]]


def long_messages(
    passages: list[str],
    count: int,
    min_tokens: int,
    max_tokens: int,
    tokenizer: Any,
    encode: Any,
) -> list[str]:
    """``count`` documents whose chat prompts spread evenly over ``[min_tokens, max_tokens]``.

    Document ``k`` shuffles the passages with seed ``k`` (so prompts share no long prefix),
    joins them as numbered parts, cuts the text to the token budget left after the
    question, and asks one of ``LONG_QUESTIONS``.
    """
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"bad token range [{min_tokens}, {max_tokens}]")
    messages = []
    for k in range(count):
        target = round(min_tokens + (max_tokens - min_tokens) * (k + 0.5) / count)
        question = LONG_QUESTIONS[k % len(LONG_QUESTIONS)]
        header = "Read the following document.\n\n"
        footer = f"\n\n{question}"
        overhead = len(encode(header + footer))
        order = list(passages)
        random.Random(k).shuffle(order)
        body_ids: list[int] = []
        part = 0
        while len(body_ids) < target:  # cycle through the passages until long enough
            for passage in order:
                part += 1
                body_ids += tokenizer.encode(
                    f"Part {part}.\n{passage}\n\n", add_special_tokens=False
                )
                if len(body_ids) >= target:
                    break
        budget = max(target - overhead, 1)
        for _ in range(8):  # re-tokenizing the cut text can shift the count by a few tokens
            body = tokenizer.decode(body_ids[:budget]).strip()
            length = len(encode(header + body + footer))
            if length == target:
                break
            budget += target - length
        messages.append(header + body + footer)
    return messages


# -- the tokenizer and model folder ---------------------------------------------------------


def resolve_model(name_or_path: str) -> tuple[Path, str | None]:
    """``(folder, gguf_file)`` of a model as ``cbgen.load_model`` finds it (converting the
    bundled model once if needed), or of a ``shape:NAME`` model (built once)."""
    from ..models.loader import BUNDLED_MODELS, _bundled_folder
    from .shapes import is_shape, shape_folder

    if is_shape(name_or_path):
        return shape_folder(name_or_path), None
    key = name_or_path.lower()
    if key in BUNDLED_MODELS:
        return _bundled_folder(key), None
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    return path, None


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a model, without loading its weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    folder, gguf_file = resolve_model(name_or_path)
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
