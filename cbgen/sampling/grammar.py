"""Grammars for structured output: compile a ``StructuredOutput`` for one tokenizer,
follow each request's tokens with a matcher, and mask the logits it disallows.

The grammar work is done by llguidance (``llguidance==1.9.1``), chosen over
xgrammar 0.2.9 by ``python bench/structured_backends.py --threads 1`` on this
project's 2-core CPU machine (SmolLM2 tokenizer, vocab 49152; medians of one
run, with another process busy on one core; runs vary by up to ~1.5x)::

                                          xgrammar 0.2.9   llguidance 1.9.1
    tokenizer info, once (ms)                      156               377
    compile JSON schema, to first mask (ms)          6.4               0.8
    compile regex (ms)                               0.4               1.0
    compile builtin JSON grammar (ms)                4.9               0.4
    fill 1 row (us/token)                            6.0              33.8
    accept (us/token)                                6.6               3.1
    fill 64 rows, loop of fills (us/step)          210              1186
    fill 64 rows, library's batch call (us/step)   185              1693
    apply to [64, 49152] float32 (us)            11602              3169

("apply" is xgrammar's C++ CPU kernel, and for llguidance, whose own helper is
a ``torch.compile`` kernel, this module's ``apply_bitmask``.) An earlier run
with 2 threads on the quiet machine agreed: fill 7.0 against 40.8 us a row,
JSON schema compile 11.5 against 0.9 ms.

xgrammar fills masks ~6x faster, llguidance compiles ~8x faster, and both are
small next to a decode step: 64 SmolLM2 rows take ~200 ms a step here (~300
tok/s), so filling 64 masks costs 0.1% (xgrammar) or 0.6% (llguidance) of it,
and a fresh schema costs less than a step either way. With timings comparable
in that sense, the install decided: llguidance is one self-contained abi3 wheel
(3 MB download, 7.8 MB installed, no dependencies), where xgrammar (1.3 MB)
needs apache-tvm-ffi (3.3 MB, 11 MB installed) and declares ``triton``
(hundreds of MB, useless on CPU) as a hard dependency on Linux x86_64, which a
plain ``pip install cbgen`` would pull in.

How llguidance is used, and why:

* llguidance has no separate compiled object: a matcher is built from the
  grammar text and builds its lexer lazily. ``GrammarCompiler.compile`` builds
  one matcher and computes its first mask (so errors surface at compile time,
  and the first mask's lexer states are built once), and each request's
  matcher is a ``deep_copy`` of that template: ~10 us instead of ~1 ms.
* llguidance never raises for grammar errors or bad tokens; it enters a sticky
  error state. Compile turns that into ``ValueError`` (with the library's
  message), and ``GrammarMatcher.accept`` checks a token with
  ``validate_tokens`` before consuming it, so a disallowed token leaves the
  state unchanged instead of poisoning the matcher.
* EOS: the library's tokenizer is built with the stop token(s) as its EOS
  tokens. The mask allows them exactly when the grammar is complete (for a
  grammar that can still continue, beside the continuations); once the grammar
  cannot extend further, they are the only allowed tokens
  (``is_terminated`` is then true), and accepting one returns True and keeps
  it so (``accept`` answers that itself: the library's ``validate_tokens``
  refuses even EOS once stopped). Tokens that are neither in the grammar nor
  EOS (the chat markers, the model's padding rows) are never allowed.
* Regexes match the whole output, with ``\\d`` and ``\\w`` meaning ASCII (JSON
  Schema and JavaScript semantics): the library's default, Rust's Unicode
  classes, let ``\\d{3}`` produce "３൧9" in random walks.
* JSON (schemas and ``json_object``) is generated compact, without free
  whitespace: the output is canonical and short, and a model cannot wander
  into endless newlines between tokens (a known failure of small models under
  flexible whitespace). A schema's own ``"x-guidance"`` options can still ask
  for whitespace.
* Masks are applied by this module (``apply_bitmask``), not the library:
  llguidance's torch helper is a ``torch.compile`` kernel, and on CPU the
  table unpack here beat xgrammar's C++ kernel too.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .structured import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "allocate_bitmask",
    "apply_bitmask",
    "fill_bitmasks",
]

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated grammar for one tokenizer; cheap to start matchers from."""

    key: tuple[str, str]
    grammar: str  # llguidance's grammar text (JSON)
    vocab_size: int  # the model's: the width of its logits and of a bitmask row
    eos_token_ids: tuple[int, ...]
    template: Any  # llguidance.LLMatcher at its start state, first mask computed; never advanced


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer and model, with a bounded LRU cache.

    Safe to call from several threads (the online engine validates requests on
    the callers' threads): the cache is locked, and compiling runs outside the
    lock, so one slow grammar does not hold up the others. Two threads compiling
    the same new spec at once both compile; the first result is kept and returned
    to both.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        cache_size: int = 256,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        """``vocab_size`` is the model's (its logits' width): ids the tokenizer lacks
        (padding rows of the embedding) are never allowed. ``eos_token_ids`` are the
        tokens that end a complete output (default: the tokenizer's EOS)."""
        import llguidance.hf

        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
        if not eos or any(not isinstance(t, int) for t in eos):
            raise ValueError(f"need at least one integer EOS token id, got {eos}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._hf_tokenizer = tokenizer
        self._bitmask_words = (vocab_size + 31) // 32
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar for ``spec``; ``ValueError`` names what is wrong with it."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(key)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request."""
        compiled = self.compile(spec)
        section = spec.after_reasoning
        if section is None:
            return GrammarMatcher(compiled)
        start = None if section.start is None else self.marker_ids(section.start)
        return GrammarMatcher(compiled, ReasoningGate(self.marker_ids(section.end), start))

    def marker_ids(self, text: str) -> tuple[int, ...]:
        """A marker's token ids, as the tokenizer encodes it alone."""
        ids = self._hf_tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"the marker {text!r} encodes to no tokens")
        return tuple(int(t) for t in ids)

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        import llguidance
        from llguidance import LLMatcher

        kind, text = key
        try:
            if kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
            elif kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=_JSON_OPTIONS
                )
            elif kind == "regex":
                # \d and \w mean ASCII, as in JSON Schema and JavaScript, not any Unicode digit.
                grammar = LLMatcher.grammar_from_lark(
                    f"start: /{llguidance.regex_to_lark(text, 'dw')}/"
                )
            else:  # Lark, or GBNF converted to Lark
                grammar = llguidance.grammar_from("grammar", text)
        except ValueError as exc:
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {exc}") from None
        template = LLMatcher(self._tokenizer, grammar, log_level=0)
        if not template.is_error():
            # The first mask builds the lexer states every request starts with.
            scratch = torch.empty(self._bitmask_words, dtype=torch.int32)
            template.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        if template.is_error():
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {template.get_error().strip()}")
        return CompiledGrammar(key, grammar, self.vocab_size, self.eos_token_ids, template)


@dataclass(frozen=True)
class ReasoningGate:
    """``ReasoningSection``'s markers as token ids: the grammar waits until ``end``."""

    end: tuple[int, ...]
    start: tuple[int, ...] | None  # None: the output begins inside the section


_ACTIVE = -1  # the grammar governs (no gate, or the section is over)
_REASONING = -2  # inside the section: every token allowed, watching for the end marker
# 0 .. len(start) - 1: at the output's start, that many of the start marker's tokens seen


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and when it is done.

    With a ``ReasoningGate`` the grammar waits: every token is allowed inside the
    reasoning section, and the grammar starts after the section's end marker."""

    def __init__(self, compiled: CompiledGrammar, gate: ReasoningGate | None = None) -> None:
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self.eos_token_ids = compiled.eos_token_ids
        self._matcher = compiled.template.deep_copy()
        self.gate = gate
        self._state = self._initial_state()
        self._tail: list[int] = []  # the last tokens of the section, to find its end

    def _initial_state(self) -> int:
        if self.gate is None:
            return _ACTIVE
        return _REASONING if self.gate.start is None else 0

    @property
    def active(self) -> bool:
        """The grammar governs the next token (no reasoning section, or it has ended)."""
        return self._state == _ACTIVE

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; ``False`` (state unchanged) if the grammar forbids it."""
        token_id = int(token_id)  # numpy and 0-d tensor ids too
        if not 0 <= token_id < self.vocab_size:
            return False
        if self._state != _ACTIVE:
            taken = self._gate_accept(token_id)
            if taken is not None:
                return taken
        if self._matcher.is_stopped():
            # Finished or failed: only EOS may follow (the library's validate_tokens
            # refuses even that, while its mask allows it).
            return token_id in self.eos_token_ids
        # consume_token alone would put the matcher in a sticky error state on a bad token.
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self._matcher.consume_token(token_id))

    def _gate_accept(self, token_id: int) -> bool | None:
        """Advance the reasoning gate by one token: ``True`` taken, ``False`` refused,
        ``None`` the grammar's to take (the output did not open the section)."""
        gate = self.gate
        assert gate is not None
        if self._state == _REASONING:
            self._tail = (self._tail + [token_id])[-len(gate.end) :]
            if tuple(self._tail) == gate.end:
                self._state = _ACTIVE
            return True
        start = gate.start
        assert start is not None
        seen = self._state
        if token_id == start[seen]:
            self._state = _REASONING if seen + 1 == len(start) else seen + 1
            return True
        if seen:
            return False  # inside the start marker: only its next token
        self._state = _ACTIVE  # no reasoning: the grammar takes this first token
        return None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``t % 32`` of word ``t // 32``)."""
        self._check(bitmask)
        target = bitmask[row]
        if not target.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        if self._state == _REASONING:
            target.fill_(-1)
            return
        start = self.gate.start if self.gate is not None else None
        if start is not None and self._state > 0:  # inside the start marker: its next token
            target.zero_()
            _allow(target, start[self._state])
            return
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        if start is not None and self._state == 0:  # the first token may open the section
            _allow(target, start[0])

    def _check(self, bitmask: torch.Tensor) -> None:
        # The library writes through a raw pointer: a wrong buffer must fail here.
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
            raise ValueError("bitmask must be a 2-D int32 CPU tensor (see allocate_bitmask)")
        if bitmask.shape[1] != (self.vocab_size + 31) // 32:
            raise ValueError(
                f"bitmask has {bitmask.shape[1]} words a row, the vocab of "
                f"{self.vocab_size} needs {(self.vocab_size + 31) // 32}"
            )

    @property
    def is_terminated(self) -> bool:
        """The grammar cannot go on: only EOS is allowed now, or EOS was accepted."""
        return self._state == _ACTIVE and bool(self._matcher.is_stopped())

    @property
    def is_complete(self) -> bool:
        """The output so far matches the whole grammar (EOS is allowed), though it may go on."""
        return self._state == _ACTIVE and bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the library gave up (e.g. a parser resource limit), else ``None``; such a
        matcher is terminated and allows only EOS, so the request can end normally
        while the engine reports the error."""
        return self._matcher.get_error() or None

    def reset(self) -> None:
        """Back to the start (a preempted request that recomputes its tokens)."""
        self._matcher.reset()
        self._state = self._initial_state()
        self._tail = []


def _allow(row: torch.Tensor, token_id: int) -> None:
    """Set token ``token_id``'s bit in one bitmask row."""
    word, bit = divmod(token_id, 32)
    value = int(row[word].item()) | (1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """``matchers[i].fill(bitmask, rows[i])`` for all ``i`` (``rows`` None: row ``i``) in one
    call, which the library spreads over ``torch.get_num_threads()`` threads without the GIL.

    For machines with cores to spare: on the 2-core bench machine it was within
    noise of a loop of ``fill`` (0.7x-1.3x over runs, 64 rows of ~35 us each).
    """
    if rows is not None and len(rows) != len(matchers):
        raise ValueError(f"{len(rows)} rows for {len(matchers)} matchers")
    if not matchers:
        return
    for matcher in matchers:
        matcher._check(bitmask)
    if not bitmask.is_contiguous():
        raise ValueError("bitmask must be contiguous")
    targets = range(len(matchers)) if rows is None else rows
    if any(not 0 <= int(row) < bitmask.shape[0] for row in targets):
        raise ValueError(f"a row is outside the bitmask's {bitmask.shape[0]} rows")
    pairs = []
    for matcher, row in zip(matchers, targets, strict=True):
        if matcher.active:
            pairs.append((matcher._matcher, int(row)))
        else:  # a reasoning gate's row: filled by the matcher itself
            matcher.fill(bitmask, int(row))
    if not pairs:
        return
    # llguidance.torch.fill_next_token_bitmask_par does the same, but importing that
    # module builds a torch.compile kernel (seconds of torch._dynamo import).
    _executor().unsafe_compute_mask_ptr(
        pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
    )


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor(num_threads=torch.get_num_threads())


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 ``[rows, ceil(vocab_size / 32)]`` bitmask with every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# _KEEP[b, j]: all ones if bit j of byte b is set (token allowed), else zero.
_KEEP = torch.where((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, -1, 0)
# Logits are masked as integers of the same width: x & keep | -inf & ~keep.
_SAME_WIDTH_INT = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


@functools.cache
def _keep_table(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """The byte table in ``dtype``'s integer twin, and the bits of -inf in that twin."""
    int_dtype = _SAME_WIDTH_INT[dtype]
    neg_inf = torch.tensor(float("-inf"), dtype=dtype).view(int_dtype).item()
    return _KEEP.to(device=device, dtype=int_dtype), int(neg_inf)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the whole batch at once.

    ``bitmask[i]`` applies to ``logits[rows[i]]`` (distinct rows; ``rows`` None: to
    ``logits[i]``), so a batch where only some requests are constrained masks only
    those rows. The bitmask is unpacked a byte at a time through a 256-entry table
    into an integer keep-mask, applied with two bitwise ops on the logits' bits:
    no Python loop, and on one CPU thread 3-4 ms for [64, 49152] float32 against
    7-12 ms for xgrammar's C++ kernel and 14-25 ms for ``masked_fill_`` with a bool
    mask (torch's slow path). Masked logits become exactly -inf, even +inf or NaN
    ones. Tokens past the logits' width are ignored.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError("bitmask must be a 2-D int32 tensor (see allocate_bitmask)")
    if logits.dim() != 2 or logits.dtype not in _SAME_WIDTH_INT:
        raise ValueError("logits must be a 2-D float tensor")
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens, logits have {vocab}")
    count = bitmask.shape[0]
    if rows is None and count != logits.shape[0]:
        raise ValueError(f"{count} bitmask rows for {logits.shape[0]} logits rows")
    if rows is not None and tuple(rows.shape) != (count,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, the bitmask has {count} rows")
    if count == 0:
        return
    assert sys.byteorder == "little"  # token 32 w + j is bit j of word w, in byte j // 8
    table, neg_inf = _keep_table(logits.dtype, logits.device)
    packed = bitmask.to(logits.device).contiguous().view(torch.uint8).reshape(-1).long()
    keep = table.index_select(0, packed).view(count, -1)[:, :vocab]
    bits = logits.view(table.dtype)
    if rows is not None:
        rows = rows.to(device=logits.device, dtype=torch.long)
        target = bits.index_select(0, rows)
    else:
        target = bits
    target.bitwise_and_(keep)
    target.bitwise_or_(keep.bitwise_not_().bitwise_and_(neg_inf))  # keep is scratch
    if rows is not None:
        bits.index_copy_(0, rows, target)
