"""Measure the two grammar libraries cbgen could use for structured output, on CPU.

    python bench/structured_backends.py [--steps 40] [--rows 64]

With the SmolLM2 tokenizer (vocab 49152) it times, for xgrammar and llguidance:
building the tokenizer info; compiling a JSON schema (nested objects, enums,
arrays), a regex and the builtin JSON grammar (cold: no cache); filling the
next-token bitmask for one row and for 64 rows (per decode step, along random
walks that pick uniformly among the allowed tokens); accepting a token; and
applying a bitmask to [64, 49152] float32 logits (xgrammar's CPU kernel; for
llguidance, whose own helper is a ``torch.compile`` kernel, cbgen's
``apply_bitmask``). Times are medians; the machine's load shows in them,
so compare the two columns of one run, not runs on different days. The last
block times cbgen.sampling.grammar itself (template matchers, checked accepts, its
``apply_bitmask``).

xgrammar is not a cbgen dependency; to compare, install it without its
declared ``triton`` dependency: ``pip install --no-deps xgrammar==0.2.9
apache-tvm-ffi==0.1.15.post2`` (it also needs pydantic, numpy and
typing-extensions, which the venv has).

llguidance compiles lazily (the lexer is built while the first masks are
computed), so its "compile" is construction plus the first mask, and xgrammar's
is ``compile_*`` plus building a matcher and its first mask: the time a request
waits before its first constrained token in both cases.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "verified": {"type": "boolean"},
                "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
            },
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "owner"],
    "additionalProperties": False,
}
REGEX = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,5})?"


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Boolean [rows, vocab] from an int32 bitmask (bit j of word i is token 32 i + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def masked_fill_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The plain vectorized reference: shift-and-mask unpack, then ``masked_fill_``."""
    logits.masked_fill_(~unpack(bitmask, logits.shape[1]), float("-inf"))


class XGrammar:
    name = "xgrammar"
    install = "xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2"
    modules = ("xgrammar",)

    def __init__(self, tok, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id]
        )
        threads = torch.get_num_threads()
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, text: str):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        return c.compile_builtin_json_grammar()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"
    install = "llguidance==1.9.1"
    modules = ("llguidance", "llguidance.hf", "llguidance.torch")

    def __init__(self, tok, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=torch.get_num_threads())

    def compile(self, kind: str, text: str):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = M.grammar_from_regex(text)
        else:
            grammar = M.grammar_from_json_schema(
                {"type": "object"}, defaults={"whitespace_flexible": False}
            )
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tokenizer, compiled)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms, bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(ms)], bitmask
        )

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # llguidance.torch's own helper is a torch.compile kernel (a C++ toolchain on CPU);
        # what cbgen would run with it is its own table unpack.
        from cbgen.sampling.grammar import apply_bitmask

        apply_bitmask(logits, bitmask)


def pick(bitmask: torch.Tensor, row: int, vocab_size: int, gen: torch.Generator) -> int:
    allowed = unpack(bitmask[row : row + 1], vocab_size)[0].nonzero().flatten()
    return int(allowed[torch.randint(len(allowed), (1,), generator=gen)])


def bench(backend, vocab_size: int, steps: int, rows: int, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    bitmask = torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    specs = {
        "json_schema": json.dumps(SCHEMA),
        "regex": REGEX,
        "builtin_json": "",
    }

    def first_mask(kind: str, text: str) -> None:
        backend.fill(backend.matcher(backend.compile(kind, text)), bitmask, 0)

    for kind, text in specs.items():
        first_mask(kind, text)  # warm-up: imports, thread pools
        out[f"compile {kind} (ms)"] = 1e3 * median_time(
            lambda k=kind, t=text: first_mask(k, t), repeat
        )

    compiled = backend.compile("json_schema", specs["json_schema"])
    gen = torch.Generator().manual_seed(0)

    # One row: a random walk, timing each fill and each accept.
    fills, accepts = [], []
    m = backend.matcher(compiled)
    for _ in range(steps):
        start = time.perf_counter()
        backend.fill(m, bitmask, 0)
        fills.append(time.perf_counter() - start)
        token = pick(bitmask, 0, vocab_size, gen)
        start = time.perf_counter()
        assert backend.accept(m, token)
        accepts.append(time.perf_counter() - start)
        if backend.done(m):
            m = backend.matcher(compiled)
    out["fill 1 row (us/token)"] = 1e6 * statistics.median(fills)
    out["accept (us/token)"] = 1e6 * statistics.median(accepts)

    # 64 rows in lockstep, each on its own walk: the library's batched fill, and a Python loop.
    ms = [backend.matcher(compiled) for _ in range(rows)]
    batched, looped = [], []

    def loop() -> None:
        for i, m in enumerate(ms):
            backend.fill(m, bitmask, i)

    for step in range(steps):
        order = [(batched, lambda: backend.fill_batch(ms, bitmask)), (looped, loop)]
        for times, fill in order if step % 2 else order[::-1]:
            start = time.perf_counter()
            fill()
            times.append(time.perf_counter() - start)
        for i in range(rows):
            assert backend.accept(ms[i], pick(bitmask, i, vocab_size, gen))
            if backend.done(ms[i]):
                ms[i] = backend.matcher(compiled)
    out[f"fill {rows} rows batched (us/step)"] = 1e6 * statistics.median(batched)
    out[f"fill {rows} rows looped (us/step)"] = 1e6 * statistics.median(looped)

    logits = torch.randn(rows, vocab_size)
    out[f"apply [{rows},{vocab_size}] (us)"] = 1e6 * median_time(
        lambda: backend.apply(logits, bitmask), 4 * repeat
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per walk")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of each compile")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from cbgen.models.loader import load_model

    model, tok = load_model("smollm2")
    vocab_size = model.get_input_embeddings().weight.shape[0]
    del model

    results: dict[str, dict[str, float]] = {}
    for cls in (XGrammar, LLGuidance):
        try:
            for module in cls.modules:  # imports are not part of building the tokenizer info
                importlib.import_module(module)
            start = time.perf_counter()
            backend = cls(tok, vocab_size)
        except ImportError as exc:
            print(f"skipping {cls.name}: {exc} (pip install --no-deps {cls.install})")
            continue
        results[cls.name] = {"tokenizer info (ms)": 1e3 * (time.perf_counter() - start)}
        results[cls.name].update(bench(backend, vocab_size, args.steps, args.rows, args.repeat))

    names = list(results)
    print(f"SmolLM2 tokenizer, vocab {vocab_size}, torch threads {torch.get_num_threads()}")
    print(f"{'':40}" + "".join(f"{n + ' ' + metadata.version(n):>20}" for n in names))
    for key in results[names[0]] if names else ():
        print(f"{key:40}" + "".join(f"{results[n][key]:20.1f}" for n in names))
    print()
    for key, value in module_bench(tok, vocab_size, args.rows, args.repeat).items():
        print(f"{key:40}{value:20.1f}")


def module_bench(tok, vocab_size: int, rows: int, repeat: int) -> dict[str, float]:
    """What cbgen.sampling.grammar adds on top of the library: template copies, checked accepts."""
    from cbgen.sampling.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
    from cbgen.sampling.structured import StructuredOutput

    out: dict[str, float] = {}
    import llguidance.hf  # noqa: F401  (as above: the import is not timed)

    start = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab_size, cache_size=1)
    out["cbgen.sampling.grammar: GrammarCompiler (ms)"] = 1e3 * (time.perf_counter() - start)
    spec, other = StructuredOutput(json_schema=SCHEMA), StructuredOutput(regex=REGEX)

    def misses() -> None:  # with cache_size=1, each evicts the other
        compiler.compile(other)
        compiler.compile(spec)

    out["  compile regex + json_schema, uncached (ms)"] = 1e3 * median_time(misses, repeat)
    compiler.compile(spec)
    out["  matcher() from the cache (us)"] = 1e6 * median_time(lambda: compiler.matcher(spec), 20)
    bitmask = allocate_bitmask(rows, vocab_size)
    gen = torch.Generator().manual_seed(0)
    m, fills, accepts = compiler.matcher(spec), [], []
    for _ in range(40):
        start = time.perf_counter()
        m.fill(bitmask, 0)
        fills.append(time.perf_counter() - start)
        token = pick(bitmask, 0, vocab_size, gen)
        start = time.perf_counter()
        assert m.accept(token)
        accepts.append(time.perf_counter() - start)
        if m.is_terminated:
            m = compiler.matcher(spec)
    out["  fill 1 row (us/token)"] = 1e6 * statistics.median(fills)
    out["  accept, checked (us/token)"] = 1e6 * statistics.median(accepts)
    logits = torch.randn(rows, vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, bitmask.shape, dtype=torch.int32, generator=gen)
    out[f"  apply_bitmask [{rows},{vocab_size}] (us)"] = 1e6 * median_time(
        lambda: apply_bitmask(logits, bitmask), 4 * repeat
    )
    out[f"  masked_fill_ reference [{rows},{vocab_size}] (us)"] = 1e6 * median_time(
        lambda: masked_fill_apply(logits, bitmask), 4 * repeat
    )
    half = torch.arange(0, rows, 2)
    out[f"  apply_bitmask, {rows // 2} of {rows} rows (us)"] = 1e6 * median_time(
        lambda: apply_bitmask(logits, bitmask[: rows // 2], rows=half), 4 * repeat
    )
    return out


if __name__ == "__main__":
    main()
