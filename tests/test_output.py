"""The output processor: placeholders when a step is launched, tokens and stop rules when
its samples are known (the two halves the synchronous loop runs back to back)."""

from __future__ import annotations

from cbgen import SamplingParams
from cbgen.core.output_processor import PLACEHOLDER_TOKEN, OutputProcessor
from cbgen.requests.request import FinishReason, Request, RequestStatus
from cbgen.requests.scheduler_output import ScheduledRequest, SchedulerOutput

EOS = 2


def _request(rid, prompt, **params):
    return Request(rid, list(prompt), SamplingParams(**params), arrival_order=0)


def _step(*chunks):
    """A step as the scheduler plans it (it counts the tokens as computed), and the
    requests by id."""
    out = SchedulerOutput()
    for r, n in chunks:
        start = r.num_computed_tokens
        tokens = r.token_ids[start : start + n]
        sample = start + n == r.num_tokens
        out.scheduled.append(ScheduledRequest(r.request_id, tokens, start, [[]], sample, r.params))
        r.num_computed_tokens += n
    return out, {r.request_id: r for r, _ in chunks}


def test_a_chunk_that_ends_mid_prompt_samples_nothing():
    processor = OutputProcessor({EOS}, max_model_len=100)
    request = _request("a", [5] * 10, max_new_tokens=4)
    pending = processor.advance(*_step((request, 6)))
    assert pending.requests == [] and request.num_computed_tokens == 6
    assert request.token_ids == [5] * 10  # no placeholder: no sample this step


def test_advance_then_resolve_writes_tokens_over_placeholders():
    processor = OutputProcessor({EOS}, max_model_len=100)
    a, b = _request("a", [5, 6, 7], max_new_tokens=4), _request("b", [8, 9], max_new_tokens=4)
    pending = processor.advance(*_step((a, 3), (b, 2)))
    assert pending.requests == [a, b] and pending.positions == [3, 2]
    assert a.token_ids[-1] == PLACEHOLDER_TOKEN and a.pending_index == 3
    assert (a.num_computed_tokens, b.num_computed_tokens) == (3, 2)
    outputs, finished = processor.resolve(pending, [11, 12])
    assert [o.new_token_ids for o in outputs] == [[11], [12]]
    assert a.token_ids == [5, 6, 7, 11] and a.pending_index is None
    assert [o.token_ids for o in outputs] == [[11], [12]] and finished == []
    assert not any(o.finished for o in outputs)


def test_stop_rules_and_their_reasons():
    processor = OutputProcessor({EOS}, max_model_len=6)
    eos = _request("eos", [5], max_new_tokens=9)
    stop = _request("stop", [5], max_new_tokens=9, eos_token_ids=[42])
    length = _request("length", [5], max_new_tokens=1)
    ignore = _request("ignore", [5], max_new_tokens=9, ignore_eos=True)
    context = _request("context", [5, 5, 5, 5, 5], max_new_tokens=9)
    step = _step(*[(r, r.num_tokens) for r in (eos, stop, length, ignore, context)])
    outputs, finished = processor.resolve(processor.advance(*step), [EOS, 42, 7, EOS, 7])
    reasons = {o.request_id: o.finish_reason for o in outputs}
    assert reasons == {
        "eos": FinishReason.EOS,
        "stop": FinishReason.STOP,
        "length": FinishReason.LENGTH,
        "ignore": None,  # the model's EOS is just a token when ignore_eos is set
        "context": FinishReason.CONTEXT_LIMIT,  # 5 prompt tokens + 1 fill the context of 6
    }
    assert [(r.request_id, reason) for r, reason in finished] == [
        (rid, reason) for rid, reason in reasons.items() if reason is not None
    ]


def test_a_failed_row_finishes_alone_without_a_token():
    processor = OutputProcessor({EOS}, max_model_len=100)
    a, b = _request("a", [5, 6], max_new_tokens=4), _request("b", [8], max_new_tokens=4)
    pending = processor.advance(*_step((a, 2), (b, 1)))
    outputs, finished = processor.resolve(pending, [0, 13], {0: "processor failed"})
    assert outputs[0].finish_reason is FinishReason.ERROR and outputs[0].error == "processor failed"
    assert outputs[0].new_token_ids == [] and a.token_ids == [5, 6]  # placeholder removed
    assert outputs[1].new_token_ids == [13] and finished == [(a, FinishReason.ERROR)]


def test_a_request_finished_while_its_step_ran_is_skipped():
    processor = OutputProcessor({EOS}, max_model_len=100)
    a = _request("a", [5, 6], max_new_tokens=4)
    pending = processor.advance(*_step((a, 2)))
    a.finish_reason = FinishReason.ABORTED  # aborted while the step was in flight
    a.status = RequestStatus.FINISHED
    outputs, finished = processor.resolve(pending, [11])
    assert outputs == [] and finished == [] and a.pending_index is None
