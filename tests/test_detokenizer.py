"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.requests.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Größe, naïve café — déjà vu.",
    "日本語のテキストと中文文本。",
    "emoji: 🙂🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵 done",
    "code:\n    def f(x):\n        return x ** 2  # ok\n\n\ttabs\tand  spaces  ",
    "mixed 🙂 日本 Grüße 123 ∑∫√ ≠ ≤",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from cbgen.models.loader import _bundled_folder

    return AutoTokenizer.from_pretrained(_bundled_folder("smollm2"), local_files_only=True)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream_text(tokenizer, prompt, ids, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(tokenizer, text, chunk):
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    deltas = stream_text(tokenizer, prompt, ids, chunk)
    assert "".join(deltas) == decode(tokenizer, ids) == text
    assert not any("\ufffd" in d for d in deltas), "a broken character was emitted"


def test_half_characters_are_held_back(tokenizer):
    ids = tokenizer.encode("日本")
    pieces = [decode(tokenizer, [i]) for i in ids]
    assert any(p.endswith("\ufffd") for p in pieces), "the test needs a character split in ids"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "日本"
    # Nothing comes out until a character is whole, and then it comes out at once.
    assert all(d in ("", "日", "本") for d in deltas)


def test_flush_emits_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ab日")
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push([i]) for i in ids[:-1])
    assert text == "ab"
    assert detok.flush() == decode(tokenizer, ids[:-1])[len("ab") :]
    assert detok.text == decode(tokenizer, ids[:-1])


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there") + [eos]
    deltas = stream_text(tokenizer, [], ids)
    assert "".join(deltas) == "Hi there"


def test_long_sequences_trim_their_window(tokenizer):
    text = " ".join(TEXTS) * 8
    ids = tokenizer.encode(text)
    assert len(ids) > 600
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == text
    assert len(detok._ids) < 300


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list("ab xyZ.,\n\té日本語🙂🚀ß∑")), min_size=1, max_size=40
    ),
    chunk=st.integers(1, 4),
)
def test_random_texts_roundtrip(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    deltas = stream_text(tokenizer, tokenizer.encode("x"), ids, chunk)
    assert "".join(deltas) == decode(tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)


# -- stop strings ---------------------------------------------------------------------


def feed_all(matcher, pieces):
    out, matched = [], False
    for i, piece in enumerate(pieces):
        safe, matched = matcher.feed(piece, final=i == len(pieces) - 1)
        out.append(safe)
        if matched:
            break
    return "".join(out), matched


def test_stop_string_split_across_pieces():
    text, matched = feed_all(StopStringMatcher(["STOP"]), ["abc S", "T", "OP and more"])
    assert (text, matched) == ("abc ", True)


def test_partial_match_is_held_back_then_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("OOL") == ("STOOL", False)
    assert matcher.feed("xyz S") == ("xyz ", False)
    assert matcher.feed("", final=True) == ("S", False)


def test_earliest_of_several_stops_wins():
    matcher = StopStringMatcher(["world", "lo w", "zzz"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo w"
    assert matcher.feed("more") == ("", True)


def test_stop_strings_are_validated():
    with pytest.raises(ValueError):
        StopStringMatcher([""])
    with pytest.raises(ValueError):
        StopStringMatcher([])


def test_stop_string_across_real_token_boundaries(tokenizer):
    text = "The answer is forty-two, and that is final. Then more text follows."
    stop = "is final"
    ids = tokenizer.encode(text)
    pieces = [decode(tokenizer, [i]) for i in ids]
    assert not any(stop in p for p in pieces), "the stop string should span several tokens"
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher([stop])
    shown = []
    for i in ids:
        safe, matched = matcher.feed(detok.push([i]))
        shown.append(safe)
        if matched:
            break
    assert matched
    assert "".join(shown) == text[: text.index(stop)]


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="abcST ", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_matcher_agrees_with_a_plain_search(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    shown, matched = feed_all(StopStringMatcher(stops), pieces)
    # A stream ends at the first piece after which a stop string is complete, cut at the
    # earliest of the stops complete by then: a stop that starts earlier but would only
    # complete with a later piece never gets the chance ('SSa' + 'S' with stops 'a' and
    # 'SaS' shows 'SS'), as generation stops there.
    for end in bounds[1:]:
        seen = text[:end]
        hits = [seen.find(s) for s in stops if s in seen]
        if hits:
            assert matched and shown == seen[: min(hits)]
            break
    else:
        assert not matched and shown == text
