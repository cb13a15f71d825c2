"""Structured output: spec validation, compile errors and cache, and masks on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from cbgen.sampling.grammar import (
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from cbgen.sampling.structured import ReasoningSection, StructuredOutput

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
ITEMS = r"(\([a-c]+\)|x)(,(\([a-c]+\)|x))*"  # what both grammars below accept
GBNF = 'root ::= item ("," item)*\nitem ::= "(" [a-c]+ ")" | "x"\n'
LARK = 'start: item ("," item)*\nitem: "(" /[a-c]+/ ")" | "x"\n'


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2[1]


@pytest.fixture(scope="module")
def vocab(smollm2):
    return smollm2[0].get_input_embeddings().weight.shape[0]


@pytest.fixture(scope="module")
def compiler(tok, vocab):
    return GrammarCompiler(tok, vocab)


@pytest.fixture(scope="module")
def padded(tok, vocab):
    """A model whose embedding has 64 rows past the tokenizer's, stopping at EOS or <|endoftext|>."""
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    return GrammarCompiler(tok, vocab + 64, eos_token_ids=[tok.eos_token_id, endoftext])


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """The set bits of one bitmask row: a plain shift-and-mask unpack, apart from the module's table."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def walk(
    matcher: GrammarMatcher,
    vocab: int,
    seed: int,
    max_tokens: int = 300,
    explore: int | None = None,
    closers: tuple[int, ...] = (),
) -> list[int]:
    """Pick uniformly random allowed tokens until the matcher terminates or ``max_tokens``.

    After ``explore`` tokens (if given) it steers to an end: EOS when allowed, else
    the first allowed of ``closers``, else random again; an unbounded grammar
    (any JSON object) would otherwise almost never close in a uniform walk.
    """
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab)
    tokens: list[int] = []
    while not matcher.is_terminated and len(tokens) < max_tokens:
        matcher.fill(bitmask, 0)
        allowed = allowed_ids(bitmask[0], vocab)
        assert len(allowed) > 0
        choice = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        if explore is not None and len(tokens) >= explore:
            allowed_set = set(allowed.tolist())
            eos = allowed_set & set(matcher.eos_token_ids)
            steer = [t for t in closers if t in allowed_set]
            choice = min(eos) if eos else steer[0] if steer else choice
        assert matcher.accept(choice)
        tokens.append(choice)
    return tokens


def text_of(tok, tokens: list[int]) -> str:
    return tok.decode([t for t in tokens if t != tok.eos_token_id])


# --- StructuredOutput ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"regex": "a", "grammar": 'start: "a"'},
        {"json_schema": {"type": "object"}, "json_object": True},
        {"regex": "a", "json_schema": "{}"},
    ],
)
def test_validate_needs_exactly_one(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(**kwargs).validate()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": 5}, "regex must be a str"),
        ({"grammar": b"start: 'a'"}, "grammar must be a str"),
        ({"grammar": "  "}, "grammar is empty"),
        ({"json_schema": ["type", "object"]}, "must be a JSON object"),
        ({"json_schema": '"a string"'}, "must be a JSON object"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": {"enum": {1, 2}}}, "not valid JSON"),
        ({"json_object": "yes"}, "json_object must be a bool"),
    ],
)
def test_validate_types(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs).validate()


def test_key_is_canonical_and_hashable():
    as_dict = StructuredOutput(json_schema={"type": "object", "required": ["a"]})
    as_text = StructuredOutput(json_schema='{ "type" : "object",\n "required": ["a"] }')
    assert as_dict.key == as_text.key
    assert as_dict.key[0] == "json_schema"
    # Property order is the output's order, so it stays in the key.
    reordered = StructuredOutput(json_schema={"required": ["a"], "type": "object"})
    assert reordered.key != as_dict.key
    assert {as_dict: 1}[as_dict] == 1  # a dict field does not break hashing
    assert StructuredOutput(regex="a+").key == ("regex", "a+")
    assert StructuredOutput(json_object=True).key == ("json_object", "")
    StructuredOutput(json_object=True).validate()


# --- compiling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput(json_schema={"type": "objekt"}), r"(?s)invalid json schema: .*objekt"),
        (
            StructuredOutput(json_schema={"type": "string", "minLength": "x"}),
            r"(?s)invalid json schema: .*minLength",
        ),
        (StructuredOutput(regex="a(b"), r"(?s)invalid regex: .*unclosed group"),
        (StructuredOutput(grammar="start: foo"), r"(?s)invalid grammar: .*unknown name"),
        (StructuredOutput(grammar='root ::= "a" | ('), r"invalid grammar: "),
        (StructuredOutput(), "exactly one"),
    ],
)
def test_invalid_specs_raise_value_error(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_compile_cache_and_lru_bound(tok, vocab, compiler):
    first = compiler.compile(StructuredOutput(json_schema=SCHEMA))
    again = compiler.compile(StructuredOutput(json_schema=json.dumps(SCHEMA)))
    assert again is first

    small = GrammarCompiler(tok, vocab, cache_size=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    compiled_a = small.compile(a)
    compiled_b = small.compile(b)
    assert small.compile(a) is compiled_a  # a is now the most recent; b goes first
    small.compile(c)
    assert len(small) == 2
    assert small.compile(a) is compiled_a
    assert small.compile(b) is not compiled_b  # evicted, compiled anew
    assert len(small) == 2


def test_compile_from_many_threads(compiler):
    specs = [StructuredOutput(regex=f"x{i}[a-z]+") for i in range(4)] * 4
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(compiler.compile, specs))
    for spec, result in zip(specs, compiled, strict=True):
        assert result is compiler.compile(spec)  # one object per key, whoever compiled first


def test_padding_tokens_beyond_the_tokenizer_are_never_allowed(padded, vocab):
    matcher = padded.matcher(StructuredOutput(json_object=True))
    bitmask = allocate_bitmask(1, vocab + 64)
    matcher.fill(bitmask, 0)
    assert allowed_ids(bitmask[0], vocab + 64).max() < vocab
    assert not matcher.accept(vocab + 3)


# --- random walks on the real tokenizer ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_walks_validate(compiler, tok, vocab, seed):
    matcher = compiler.matcher(StructuredOutput(json_schema=SCHEMA))
    tokens = walk(matcher, vocab, seed)
    assert matcher.is_terminated  # well before 300 tokens
    value = json.loads(text_of(tok, tokens))
    jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_regex_walks_fullmatch(compiler, tok, vocab, seed):
    matcher = compiler.matcher(StructuredOutput(regex=REGEX))
    tokens = walk(matcher, vocab, seed)
    assert matcher.is_terminated
    assert re.fullmatch(REGEX, text_of(tok, tokens), re.ASCII)  # \d is [0-9]


@pytest.mark.parametrize("grammar", [GBNF, LARK], ids=["gbnf", "lark"])
@pytest.mark.parametrize("seed", range(2))
def test_grammar_walks_fullmatch(compiler, tok, vocab, grammar, seed):
    matcher = compiler.matcher(StructuredOutput(grammar=grammar))
    tokens = walk(matcher, vocab, seed)
    assert matcher.is_terminated
    assert re.fullmatch(ITEMS, text_of(tok, tokens))


@pytest.mark.parametrize("seed", range(3))
def test_json_object_walks_give_a_dict(compiler, tok, vocab, seed):
    closers = tuple(tok.encode(c, add_special_tokens=False)[0] for c in ('"', "}", "]", ":", "0"))
    matcher = compiler.matcher(StructuredOutput(json_object=True))
    tokens = walk(matcher, vocab, seed, explore=60, closers=closers)
    assert matcher.is_terminated
    assert isinstance(json.loads(text_of(tok, tokens)), dict)


# --- EOS and accept -----------------------------------------------------------------------------


def test_eos_only_when_complete(compiler, tok, vocab):
    bitmask = allocate_bitmask(1, vocab)
    matcher = compiler.matcher(StructuredOutput(regex="ab+"))
    (a,) = tok.encode("a", add_special_tokens=False)
    (b,) = tok.encode("b", add_special_tokens=False)
    eos = tok.eos_token_id
    matcher.fill(bitmask, 0)
    assert eos not in allowed_ids(bitmask[0], vocab).tolist()
    assert not matcher.accept(eos)
    assert matcher.accept(a) and matcher.accept(b)
    assert matcher.is_complete and not matcher.is_terminated  # "ab" may go on with more b
    matcher.fill(bitmask, 0)
    allowed = allowed_ids(bitmask[0], vocab).tolist()
    assert eos in allowed and b in allowed
    assert matcher.accept(eos)
    assert matcher.is_terminated and matcher.error is None
    assert not matcher.accept(b)

    done = compiler.matcher(StructuredOutput(regex="ab"))
    assert done.accept(a) and done.accept(b)
    assert done.is_terminated  # nothing can follow: only EOS remains
    done.fill(bitmask, 0)
    assert allowed_ids(bitmask[0], vocab).tolist() == [eos]
    assert not done.accept(b)
    assert done.accept(eos) and done.is_terminated


def test_several_eos_tokens(padded, tok):
    eos = padded.eos_token_ids
    assert len(eos) == 2
    for stop in eos:
        matcher = padded.matcher(StructuredOutput(regex="a+"))
        assert not matcher.accept(stop)  # not before the grammar is complete
        assert matcher.accept(tok.encode("a", add_special_tokens=False)[0])
        bitmask = allocate_bitmask(1, padded.vocab_size)
        matcher.fill(bitmask, 0)
        assert set(eos) <= set(allowed_ids(bitmask[0], padded.vocab_size).tolist())
        assert matcher.accept(stop) and matcher.is_terminated


def test_disallowed_accept_leaves_state_unchanged(compiler, tok, vocab):
    matcher = compiler.matcher(StructuredOutput(json_schema=SCHEMA))
    for token in tok.encode('{"name":"Rex","kind":"', add_special_tokens=False):
        assert matcher.accept(token)
    before, after = allocate_bitmask(1, vocab), allocate_bitmask(1, vocab)
    matcher.fill(before, 0)
    (x,) = tok.encode("x", add_special_tokens=False)
    for bad in (x, tok.eos_token_id, 1, -1, vocab, vocab + 1000):
        assert not matcher.accept(bad)
    assert matcher.error is None
    matcher.fill(after, 0)
    assert torch.equal(before, after)
    for token in tok.encode('dog"', add_special_tokens=False):
        assert matcher.accept(token)


def test_a_failed_matcher_allows_only_eos(compiler, tok, vocab):
    matcher = compiler.matcher(StructuredOutput(regex="ab"))
    matcher._matcher.consume_token(
        tok.encode("x", add_special_tokens=False)[0]
    )  # as a library failure
    assert matcher.error and matcher.is_terminated
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill(bitmask, 0)
    assert allowed_ids(bitmask[0], vocab).tolist() == [tok.eos_token_id]
    assert not matcher.accept(tok.encode("a", add_special_tokens=False)[0])
    assert matcher.accept(tok.eos_token_id)


def test_matchers_are_independent_and_reset(compiler, tok, vocab):
    spec = StructuredOutput(regex="ab|cd")
    one, two = compiler.matcher(spec), compiler.matcher(spec)
    (a,) = tok.encode("a", add_special_tokens=False)
    (c,) = tok.encode("c", add_special_tokens=False)
    assert one.accept(a) and two.accept(c)
    assert not one.accept(c)
    one.reset()
    assert one.accept(c)


def test_fill_rejects_a_wrong_bitmask(compiler, vocab):
    matcher = compiler.matcher(StructuredOutput(json_object=True))
    with pytest.raises(ValueError, match="words a row"):
        matcher.fill(allocate_bitmask(1, vocab - 64), 0)
    with pytest.raises(ValueError, match="int32"):
        matcher.fill(torch.zeros(1, (vocab + 31) // 32, dtype=torch.int64), 0)


# --- apply_bitmask ------------------------------------------------------------------------------


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_bitmask_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are ignored
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    logits[0, :6] = torch.tensor([float("inf"), float("nan"), float("-inf")] * 2)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    bitmask[0, 0] = 0b010101  # tokens 0, 2, 4 allowed; +inf 3 and nan 1 masked, too
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    expected = reference_apply(logits, bitmask, [0, 1, 2])
    apply_bitmask(logits, bitmask)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0, equal_nan=True)
    assert logits[0, 1] == logits[0, 3] == float("-inf")
    assert (logits[2] == float("-inf")).all() and torch.isfinite(logits[1]).all()


def test_apply_bitmask_rows():
    gen = torch.Generator().manual_seed(1)
    vocab = 70
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32, generator=gen)
    expected = reference_apply(logits, bitmask, [3, 1])
    apply_bitmask(logits, bitmask, rows=torch.tensor([3, 1]))
    assert torch.equal(logits, expected)  # rows 0, 2 and 4 untouched

    with pytest.raises(ValueError, match="rows"):
        apply_bitmask(logits, bitmask, rows=torch.tensor([0]))
    with pytest.raises(ValueError, match="bitmask rows"):
        apply_bitmask(logits, bitmask)


def test_apply_bitmask_with_a_matcher(compiler, vocab):
    bitmask = allocate_bitmask(4, vocab)  # rows left as allocated allow every token
    compiler.matcher(StructuredOutput(regex="[0-9]{2}")).fill(bitmask, 2)
    logits = torch.randn(4, vocab)
    original = logits.clone()
    apply_bitmask(logits, bitmask)
    allowed = allowed_ids(bitmask[2], vocab)
    assert torch.equal(logits[[0, 1, 3]], original[[0, 1, 3]])
    assert torch.equal(logits[2, allowed], original[2, allowed])
    assert torch.isfinite(logits[2]).sum() == len(allowed) > 0


def test_regex_classes_are_ascii_and_slashes_work(compiler, tok):
    matcher = compiler.matcher(StructuredOutput(regex=r"\d/\w"))
    assert not matcher.accept(tok.encode("٢", add_special_tokens=False)[0])
    for token in tok.encode("1/a", add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.is_terminated


def test_fill_bitmasks_matches_fill(compiler, tok, vocab):
    specs = [StructuredOutput(json_schema=SCHEMA), StructuredOutput(regex=REGEX)]
    matchers = [compiler.matcher(specs[i % 2]) for i in range(5)]
    for i, matcher in enumerate(matchers):  # each at its own state
        walk(matcher, vocab, seed=i, max_tokens=i + 1)
    one_by_one, batched = allocate_bitmask(7, vocab), allocate_bitmask(7, vocab)
    rows = [6, 0, 3, 2, 5]
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill(one_by_one, row)
    fill_bitmasks(matchers, batched, rows)
    assert torch.equal(one_by_one, batched)  # rows 1 and 4 still allow everything
    fill_bitmasks(matchers[:2], batched)
    assert torch.equal(batched[:2], one_by_one[[6, 0]])
    with pytest.raises(ValueError, match="words a row"):
        fill_bitmasks(matchers, allocate_bitmask(5, vocab + 64))
    with pytest.raises(ValueError, match="outside"):
        fill_bitmasks(matchers[:1], batched, [7])  # a raw-pointer write: checked first


# -- a reasoning section before the grammar -----------------------------------------------


def _allowed(matcher, vocab):
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill(bitmask, 0)
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_the_grammar_waits_for_the_end_of_reasoning(tok, vocab, compiler):
    section = ReasoningSection(end="</think>", start="<think>")
    spec = StructuredOutput(regex="[0-9]+", after_reasoning=section)
    plain = compiler.matcher(StructuredOutput(regex="[0-9]+"))
    matcher = compiler.matcher(spec)
    start, end = _ids(tok, "<think>"), _ids(tok, "</think>")
    assert len(start) > 1  # SmolLM2 spells the markers in several tokens
    # first token: what the grammar allows, or the start marker's first token
    assert _allowed(matcher, vocab) == _allowed(plain, vocab) | {start[0]}
    assert matcher.accept(start[0]) and not matcher.active
    # inside the start marker only its next token
    assert _allowed(matcher, vocab) == {start[1]}
    assert not matcher.accept(_ids(tok, "7")[0])
    for token in start[1:]:
        assert matcher.accept(token)
    # inside the section: anything, letters and EOS included; the grammar waits
    assert len(_allowed(matcher, vocab)) == vocab
    for token in _ids(tok, "I think 3 plus 3 is 6.") + end:
        assert matcher.accept(token)
        assert not matcher.is_complete and not matcher.is_terminated
    assert matcher.active
    assert _allowed(matcher, vocab) == _allowed(plain, vocab)  # the grammar's start
    assert not matcher.accept(_ids(tok, "x")[0])
    assert matcher.accept(_ids(tok, "6")[0]) and matcher.is_complete
    matcher.reset()
    assert not matcher.active and _allowed(matcher, vocab) == _allowed(plain, vocab) | {start[0]}


def test_an_output_that_does_not_open_the_section_is_the_grammars(tok, vocab, compiler):
    spec = StructuredOutput(regex="[0-9]+", after_reasoning=ReasoningSection("</think>", "<think>"))
    matcher = compiler.matcher(spec)
    assert matcher.accept(_ids(tok, "4")[0]) and matcher.active and matcher.is_complete
    refused = compiler.matcher(spec)
    assert not refused.accept(_ids(tok, "x")[0])  # neither the marker nor the grammar's


def test_a_section_open_from_the_start(tok, vocab, compiler):
    spec = StructuredOutput(regex="[0-9]+", after_reasoning=ReasoningSection("</think>"))
    matchers = [compiler.matcher(spec), compiler.matcher(StructuredOutput(regex="[a-z]+"))]
    bitmask = allocate_bitmask(2, vocab)
    fill_bitmasks(matchers, bitmask)  # the batched fill: gated rows fill themselves
    assert bool((bitmask[0] == -1).all()) and not bool((bitmask[1] == -1).all())
    for token in _ids(tok, "hmm") + _ids(tok, "</think>"):
        assert matchers[0].accept(token)
    fill_bitmasks(matchers, bitmask)
    assert not bool((bitmask[0] == -1).all())
    assert spec.key == StructuredOutput(regex="[0-9]+").key  # one compiled grammar
    with pytest.raises(ValueError, match="end"):
        StructuredOutput(regex="a", after_reasoning=ReasoningSection("")).validate()
