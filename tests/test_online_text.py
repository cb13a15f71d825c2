"""A request's text on the online loop (``cbgen.frontends.online.text``): detokenized deltas cut at
the first stop string, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from cbgen.frontends.online.text import TextProcessor, stop_matcher
from cbgen.requests.detokenizer import make_decoder

TEXT = "The quick brown fox jumps over the lazy dog. Größe, naïve café 🙂 done."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from cbgen.models.loader import _bundled_folder

    return AutoTokenizer.from_pretrained(_bundled_folder("smollm2"), local_files_only=True)


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer.encode(TEXT)


def feed(tokenizer, ids, stop=None, finish_after=None):
    """Push ``ids`` one at a time like the loop does; returns the pieces and the index of
    the token at which a stop string matched (or None)."""
    processor = TextProcessor(
        [1, 2, 3], make_decoder(tokenizer), stop_matcher("r", stop, tokenizer)
    )
    pieces = []
    last = len(ids) - 1 if finish_after is None else finish_after
    for i, token in enumerate(ids[: last + 1]):
        piece, matched = processor.push([token], finished=i == last)
        pieces.append(piece)
        if matched:
            return pieces, i
    return pieces, None


def test_without_stop_strings_the_pieces_join_to_the_decode(tokenizer, ids):
    pieces, matched_at = feed(tokenizer, ids)
    assert matched_at is None
    assert "".join(pieces) == TEXT


def test_a_stop_string_across_tokens_cuts_the_text_right_before_it(tokenizer, ids):
    decode = make_decoder(tokenizer)
    # the first token boundary after "jumps" that splits a 4-character stop string 2 + 2
    for j in range(1, len(ids)):
        boundary = len(decode(ids[:j]))
        if boundary > TEXT.index("jumps"):
            stop = TEXT[boundary - 2 : boundary + 2]
            break
    assert len(stop) == 4 and TEXT.index(stop) == boundary - 2
    pieces, matched_at = feed(tokenizer, ids, stop=["never-there", stop])
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]
    assert matched_at is not None and len(decode(ids[: matched_at + 1])) >= boundary + 2
    assert len(decode(ids[:matched_at])) < boundary + 2  # the token that completed it


def test_the_text_that_could_start_a_stop_string_is_held_back_until_the_end(tokenizer, ids):
    decode = make_decoder(tokenizer)
    stop = TEXT[-3:] + "zz"  # the text's tail starts it, but it never completes
    pieces, matched_at = feed(tokenizer, ids, stop=stop)
    assert matched_at is None and "".join(pieces) == TEXT
    # held back while the request runs: not shown until something decides
    processor = TextProcessor([1, 2, 3], decode, stop_matcher("r", stop, tokenizer))
    shown = "".join(processor.push([t], finished=False)[0] for t in ids)
    assert shown == TEXT[:-3]
    # a request that ends without a new token (aborted, timed out) releases it
    assert processor.flush() == TEXT[-3:]


def test_stop_matcher_reads_the_request_argument(tokenizer):
    assert stop_matcher("r", None, tokenizer) is None
    assert stop_matcher("r", [], tokenizer) is None
    assert stop_matcher("r", "END", tokenizer).stops == ("END",)
    assert stop_matcher("r", ("a", "b"), tokenizer).stops == ("a", "b")
    with pytest.raises(ValueError, match="request 'r7': stop strings need a tokenizer"):
        stop_matcher("r7", ["x"], None)
    with pytest.raises(ValueError, match="request 'r7': stop strings must be non-empty"):
        stop_matcher("r7", ["x", ""], tokenizer)


def test_include_stop_keeps_the_stop_string_once(tokenizer, ids):
    stop = "jumps"
    processor = TextProcessor(
        [1, 2, 3], make_decoder(tokenizer), stop_matcher("r", stop, tokenizer, include_stop=True)
    )
    pieces = []
    for token in ids:
        piece, matched = processor.push([token], False)
        pieces.append(piece)
        if matched:
            break
    pieces.append(processor.flush())
    assert "".join(pieces) == TEXT[: TEXT.index(stop) + len(stop)]


def test_special_tokens_per_request(tokenizer):
    from cbgen.frontends.online.text import Decoders, TextOptions

    decoders = Decoders(tokenizer)
    eos = tokenizer.eos_token_id
    ids = tokenizer("Hi")["input_ids"] + [eos, eos]
    texts = {}
    for skip in (True, False):
        for spaces in (True, False):
            processor = decoders.processor([1], TextOptions(skip, spaces))
            texts[skip, spaces] = processor.push(ids, True)[0]
    assert texts[True, True] == texts[True, False] == "Hi"
    # byte-level BPE puts no space before a special token: the option changes nothing
    assert texts[False, True] == texts[False, False] == "Hi" + tokenizer.eos_token * 2
