"""The online engine: background loop, streaming, results, cancellation, failures, asyncio."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time

import pytest
from conftest import hold_engine, random_prompts, reference_greedy

from cbgen import EngineConfig, SamplingParams
from cbgen.frontends.online import Engine, EngineClosedError, EngineOverloadedError
from cbgen.frontends.online.loop import CLOSE

NUM_BLOCKS = 96


def make_engine(model, tokenizer=None, **config):
    config.setdefault("num_blocks", NUM_BLOCKS)
    config.setdefault("block_size", 8)
    retained = config.pop("max_retained_results", 4096)
    unread = config.pop("max_unread_tokens", 4096)
    return Engine(
        model,
        tokenizer,
        EngineConfig(**config),
        max_retained_results=retained,
        max_unread_tokens=unread,
    )


def assert_no_leak(engine):
    """Every cancel has been applied, nothing runs, and every block is free."""
    engine.sync(timeout=30)
    core = engine.core
    assert not core.has_unfinished()
    assert core.allocator.num_free == core.allocator.num_blocks


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


def long_params(n=400):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


class Leash:
    """A logits processor that lets its request generate ``limit`` tokens, then holds the
    engine's loop thread inside the next step (which makes one token more) until the
    test lets it go on: ``extend(k)`` allows k more tokens, ``release()`` all of them.
    So a test cancels, closes or reads while the request surely still runs, however fast
    or slow the machine (400 tokens cannot run out before the test acts). Each request
    that shares it counts its own tokens past ``prompt_len``."""

    def __init__(self, prompt_len, limit=1):
        self.prompt_len, self.limit = prompt_len, limit
        self.released = False
        self.holding = threading.Condition()

    def __call__(self, token_ids, logits):
        with self.holding:
            go_on = lambda: self.released or len(token_ids) - self.prompt_len < self.limit  # noqa: E731
            if not self.holding.wait_for(go_on, 60):  # a failure guard, never a wait to run out:
                self.released = True  # a test that never lets go does not hang the engine
        return logits

    def extend(self, tokens=1):
        with self.holding:
            self.limit += tokens
            self.holding.notify_all()

    def release(self):
        with self.holding:
            self.released = True
            self.holding.notify_all()


def leashed_params(leash, n=400):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logits_processors=[leash])


def joined(deltas):
    ids = [t for d in deltas for t in d.new_token_ids]
    return ids


# -- correctness --------------------------------------------------------------------------


def test_greedy_stream_and_result_equal_generate(llama):
    prompts = random_prompts(5, 3, 30, seed=21)
    expected = [reference_greedy(llama, p, 12) for p in prompts]
    with make_engine(llama) as engine:
        streamed = [engine.add_request(p, greedy(12)) for p in prompts]
        collected = [engine.add_request(p, greedy(12)) for p in prompts]
        for rid, want in zip(streamed, expected, strict=True):
            deltas = list(engine.stream(rid))
            assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
            assert joined(deltas) == deltas[-1].token_ids == want
        results = {rid: engine.get_result(rid, timeout=30) for rid in collected}
        assert [results[rid].token_ids for rid in collected] == expected
        assert all(r.text is None for r in results.values())
        assert_no_leak(engine)
    assert llama.config._attn_implementation != "cbgen_paged"


def test_late_stream_catches_up(llama):
    prompt = [5, 9, 11, 30]
    expected = reference_greedy(llama, prompt, 30)
    with make_engine(llama) as engine:
        slow = engine.add_request(prompt, greedy(30))
        quick = engine.add_request([7, 8], greedy(3, ignore_eos=True))
        engine.get_result(quick, timeout=30)  # by now ``slow`` has at least three tokens
        deltas = list(engine.stream(slow))
        assert len(deltas[0].new_token_ids) >= 3
        assert joined(deltas) == deltas[-1].token_ids == expected
        # A finished, uncollected request streams as one final delta.
        done = engine.add_request(prompt, greedy(4))
        engine.get_result(engine.add_request(prompt, greedy(4)), timeout=30)
        (only,) = list(engine.stream(done))
        assert only.finished and only.new_token_ids == expected[:4]
        assert_no_leak(engine)


def test_text_streaming_and_stop_strings(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a cat."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    params = greedy(16, ignore_eos=True)
    with make_engine(model, tokenizer, num_blocks=64, block_size=16) as engine:
        deltas = list(engine.stream(engine.add_request(prompt, params)))
        free = deltas[-1]
        ids, text = free.token_ids, free.text
        assert "".join(d.new_text for d in deltas) == text
        assert joined(deltas) == ids
        assert text == tokenizer.decode(ids, skip_special_tokens=True) and text.strip()

        # A stop string of two characters on each side of the boundary of tokens j-1 and j.
        lens = [
            len(tokenizer.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)
        ]
        stop = end = None
        for j in range(3, len(ids) - 3):
            cut = lens[j]
            candidate = text[cut - 2 : cut + 2]
            if lens[j - 1] < cut < lens[j + 1] and text.find(candidate) == cut - 2:
                stop = candidate
                end = next(k for k in range(len(ids) + 1) if lens[k] >= cut + 2)
                break
        assert stop is not None and len(stop) == 4, text

        # Three more runs in one batch: stopped, never matched, and collected without streaming.
        stopped = engine.add_request(prompt, params, stop=["never-there", stop])
        unmatched = engine.add_request(prompt, params, stop="zzzqqq")
        plain = engine.add_request(prompt, params)
        deltas = list(engine.stream(stopped))
        final = deltas[-1]
        assert final.finish_reason == "stop"
        assert final.text == text[: text.index(stop)]
        assert "".join(d.new_text for d in deltas) == final.text
        assert final.token_ids == ids[:end]  # the token that completed the stop is the last
        out = engine.get_result(unmatched, timeout=120)
        assert (out.text, out.finish_reason) == (text, "length")
        out = engine.get_result(plain, timeout=120)
        assert (out.text, out.token_ids) == (text, ids)
        assert_no_leak(engine)


# -- results, timeouts, cancellation ------------------------------------------------------


def test_get_result_by_id_any_and_timeouts(llama):
    with make_engine(llama) as engine:
        with pytest.raises(TimeoutError):
            engine.get_result(timeout=0.02)
        with pytest.raises(KeyError):
            engine.get_result("nope", timeout=0.02)
        # The leash holds the loop once the long request has a token: it cannot finish.
        leash = Leash(prompt_len=3)
        long_id = engine.add_request([5, 6, 7], leashed_params(leash), request_id="long")
        try:
            with pytest.raises(TimeoutError):
                engine.get_result(long_id, timeout=0.01)
            # Queued behind the held step; 20 more tokens of the long one are far more
            # steps than the short ones take, so they finish while it still runs.
            short = {engine.add_request([9, 9, i + 3], greedy(4)) for i in range(3)}
            leash.extend(20)
            got = {engine.get_result(timeout=30).request_id for _ in short}
            assert got == short  # the long request is still running, so it is not among them
            with pytest.raises(KeyError):
                engine.get_result(next(iter(short)))  # already collected
            assert engine.cancel(long_id)
        finally:
            leash.release()
        out = engine.get_result(long_id, timeout=30)
        assert out.finish_reason == "aborted" and 0 < len(out.token_ids) < 400
        assert not engine.cancel(long_id)
        assert_no_leak(engine)


def test_cancel_waiting_and_running(llama):
    with make_engine(llama, max_num_seqs=1) as engine:
        leash = Leash(prompt_len=3)  # the running request cannot finish before its cancel
        running = engine.add_request([5, 6, 7], leashed_params(leash))
        waiting = engine.add_request([8, 9], long_params())
        try:
            stream = engine.stream(running)
            first = next(stream)
            assert first.new_token_ids and not first.finished
            assert engine.cancel(waiting)
            leash.extend(1)  # one step more: the cancel is applied after it
            out = engine.get_result(waiting, timeout=30)
            assert out.finish_reason == "aborted" and out.token_ids == []
            assert engine.cancel(running)
        finally:
            leash.release()
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "aborted"
        assert joined([first, *rest]) == rest[-1].token_ids
        assert_no_leak(engine)


def test_abandoned_streams_cancel_their_requests(llama):
    with make_engine(llama) as engine:
        rid = engine.add_request([5, 6, 7], long_params())
        for delta in engine.stream(rid):
            assert not delta.finished
            break  # the generator is dropped here
        gc.collect()
        never_iterated = engine.stream(engine.add_request([4, 4], long_params()))
        del never_iterated
        closed = engine.stream(engine.add_request([3, 3], long_params()))
        closed.close()
        assert_no_leak(engine)


def test_invalid_requests_raise_at_once(llama):
    with make_engine(llama) as engine:
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.add_request([5, 6], SamplingParams(max_new_tokens=0))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([5, 999])
        with pytest.raises(ValueError, match="empty"):
            engine.add_request([])
        with pytest.raises(ValueError, match="tokenizer"):
            engine.add_request([5, 6], stop=["x"])
        leash = Leash(prompt_len=2)  # "dup" is still running when it is cancelled
        rid = engine.add_request([5, 6], leashed_params(leash), request_id="dup")
        try:
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request([5, 6], request_id="dup")
            engine.cancel(rid)
        finally:
            leash.release()
        assert engine.get_result(rid, timeout=30).finish_reason == "aborted"
        assert engine.get_result(engine.add_request([5, 6], greedy(3)), timeout=30).finished
        assert_no_leak(engine)


def test_unfetched_results_are_bounded_and_streamed_ones_dropped(llama):
    with make_engine(llama, max_retained_results=3) as engine:
        ids = [engine.add_request([5, i + 3], greedy(2, ignore_eos=True)) for i in range(5)]
        engine.get_result(engine.add_request([5, 9], greedy(2, ignore_eos=True)), timeout=30)
        assert engine.num_dropped_results == 2
        assert {engine.get_result(timeout=30).request_id for _ in range(3)} == set(ids[2:])
        for rid in ids[:2]:
            with pytest.raises(KeyError):
                engine.get_result(rid, timeout=0)
        streamed = engine.add_request([5, 6], greedy(3))
        assert list(engine.stream(streamed))[-1].finished
        with pytest.raises(KeyError):
            engine.get_result(streamed, timeout=0)
        with pytest.raises(TimeoutError):
            engine.get_result(timeout=0)
        assert_no_leak(engine)


# -- failures and shutdown ----------------------------------------------------------------


def test_step_exception_fails_its_requests_and_the_engine_goes_on(llama):
    prompt = [5, 6, 7, 8]
    expected = reference_greedy(llama, prompt, 6)
    with make_engine(llama) as engine:
        real_step, calls = engine.core.step, [0]

        def flaky_step():
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("boom")
            return real_step()

        engine.core.step = flaky_step
        ids = [engine.add_request([5, i + 3, 7], greedy(20, ignore_eos=True)) for i in range(4)]
        outs = [engine.get_result(rid, timeout=30) for rid in ids]
        reasons = [o.finish_reason for o in outs]
        assert "error" in reasons and set(reasons) <= {"error", "length"}
        for out in outs:
            if out.finish_reason == "error":
                assert "boom" in out.error
        assert_no_leak(engine)
        again = engine.get_result(engine.add_request(prompt, greedy(6)), timeout=30)
        assert again.token_ids == expected
        # A rule only the core knows about also ends the request with "error".
        real_add = engine.core.add_request

        def picky_add(prompt, params, request_id, **options):
            raise ValueError(f"request {request_id!r}: not today")

        engine.core.add_request = picky_add
        out = engine.get_result(engine.add_request(prompt, greedy(6)), timeout=30)
        assert out.finish_reason == "error" and "not today" in out.error
        engine.core.add_request = real_add
        assert_no_leak(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forward_failure_fails_its_requests_and_the_engine_goes_on(llama, async_scheduling):
    prompt = [5, 6, 7, 8]
    expected = reference_greedy(llama, prompt, 6)
    with make_engine(llama, async_scheduling=async_scheduling) as engine:
        runner = engine.core.executor.runner
        real_execute, calls = runner.execute, [0]

        def flaky_execute(batch):  # on the forward worker when async
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("forward broke")
            return real_execute(batch)

        runner.execute = flaky_execute
        ids = [engine.add_request([5, i + 3, 7], greedy(20, ignore_eos=True)) for i in range(4)]
        outs = [engine.get_result(rid, timeout=30) for rid in ids]
        reasons = [o.finish_reason for o in outs]
        assert "error" in reasons and set(reasons) <= {"error", "length"}
        assert_no_leak(engine)
        again = engine.get_result(engine.add_request(prompt, greedy(6)), timeout=30)
        assert again.token_ids == expected
        assert_no_leak(engine)


def test_close_aborts_and_wakes_every_waiter(llama):
    engine = make_engine(llama).start()
    # The loop is held once a request has a token, until close() has posted its command:
    # nothing can finish before the close, however fast the machine.
    leash = Leash(prompt_len=3)
    loop_post = engine._loop.post

    def post(kind, arg):
        loop_post(kind, arg)
        if kind == CLOSE:
            leash.release()

    engine._loop.post = post
    by_id = engine.add_request([5, 6, 7], leashed_params(leash))
    streamed = engine.add_request([5, 6, 8], leashed_params(leash))
    unclaimed = engine.add_request([5, 6, 9], leashed_params(leash))
    results = {}
    started = threading.Barrier(4)

    def wait_by_id():
        started.wait()
        results["by_id"] = engine.get_result(by_id, timeout=60)

    def stream():
        started.wait()
        results["stream"] = list(engine.stream(streamed))[-1]

    def wait_any():
        started.wait()
        results["any"] = engine.get_result(timeout=60)
        try:
            engine.get_result(timeout=60)
        except EngineClosedError:
            results["closed"] = True

    threads = [threading.Thread(target=f) for f in (wait_by_id, stream, wait_any)]
    for t in threads:
        t.start()
    started.wait()
    # Peek until the by-id waiter and the stream are registered, or the any-waiter
    # could take one of their results when close() finishes them all.
    registered = threading.Event()
    while not engine._registry[by_id].waiters or engine._registry[streamed].sink is None:
        registered.wait(0.001)
    engine.close()
    for t in threads:
        t.join(timeout=60)
    assert all(not t.is_alive() for t in threads)
    assert results["by_id"].finish_reason == "aborted"
    assert results["stream"].finish_reason == "aborted"
    assert results["any"].finish_reason == "aborted"
    assert results["any"].request_id == unclaimed
    assert results.get("closed")
    assert engine.core.allocator.num_free == NUM_BLOCKS
    assert llama.config._attn_implementation != "cbgen_paged"
    with pytest.raises(EngineClosedError):
        engine.add_request([5, 6])
    engine.close()  # twice is fine


# -- concurrency --------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_many_threads_add_stream_and_cancel(llama, async_scheduling):
    prompts = random_prompts(4, 3, 20, seed=5)
    expected = [reference_greedy(llama, p, 8) for p in prompts]
    errors: list[BaseException] = []
    finished: list[str] = []
    lock = threading.Lock()

    def client(seed):
        rng = random.Random(seed)
        try:
            for i in range(10):
                k = rng.randrange(len(prompts))
                mode = (seed + i) % 4
                params = long_params(60) if mode >= 2 else greedy(8)
                rid = engine.add_request(prompts[k], params, request_id=f"t{seed}-{i}")
                if mode == 0:
                    deltas = list(engine.stream(rid))
                    assert joined(deltas) == deltas[-1].token_ids == expected[k]
                elif mode == 1:
                    assert engine.get_result(rid, timeout=60).token_ids == expected[k]
                elif mode == 2:  # cancel while streaming
                    stream = engine.stream(rid)
                    for delta in stream:
                        if delta.finished or len(delta.token_ids) >= rng.randint(1, 4):
                            break
                    engine.cancel(rid)
                    rest = list(stream)
                    assert not rest or rest[-1].finish_reason in ("aborted", "length")
                else:  # cancel at once, maybe before it even ran
                    engine.cancel(rid)
                    assert engine.get_result(rid, timeout=60).finish_reason in (
                        "aborted",
                        "length",
                    )
                with lock:
                    finished.append(rid)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with make_engine(
        llama,
        num_blocks=64,
        max_num_seqs=16,
        max_batch_tokens=128,
        async_scheduling=async_scheduling,
    ) as engine:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert len(finished) == 80
        assert_no_leak(engine)


def test_asyncio_streaming_and_results(llama):
    prompts = random_prompts(3, 4, 16, seed=8)
    expected = [reference_greedy(llama, p, 10) for p in prompts]

    async def consume(engine, rid):
        deltas = [d async for d in engine.stream_async(rid)]
        return joined(deltas), deltas[-1]

    async def main(engine):
        ids = [engine.add_request(p, greedy(10)) for p in prompts]
        got = await asyncio.gather(*(consume(engine, rid) for rid in ids))
        for (ids_seen, last), want in zip(got, expected, strict=True):
            assert ids_seen == last.token_ids == want
        # Results by id, in completion order, and timeouts.
        rid = engine.add_request(prompts[0], greedy(10))
        assert (await engine.get_result_async(rid, timeout=30)).token_ids == expected[0]
        rid = engine.add_request(prompts[1], greedy(10))
        assert (await engine.get_result_async(timeout=30)).request_id == rid
        with pytest.raises(TimeoutError):
            await engine.get_result_async(timeout=0.02)
        leash = Leash(prompt_len=len(prompts[2]))  # held after a token: it cannot finish
        slow = engine.add_request(prompts[2], leashed_params(leash))
        try:
            with pytest.raises(TimeoutError):  # it cannot finish meanwhile
                await engine.get_result_async(slow, timeout=0.01)
            # Leaving an async stream early cancels the request.
            async for delta in engine.stream_async(slow):
                assert not delta.finished
                break
            gc.collect()
            engine.cancel(slow)  # no-op if the abandoned stream already did it
        finally:
            leash.release()

    with make_engine(llama) as engine:
        asyncio.run(main(engine))
        assert_no_leak(engine)


# -- bounds -------------------------------------------------------------------------------


def _blocking_processor(release: threading.Event, entered: threading.Event):
    """A logits processor that holds the loop thread inside a step until released."""

    def hold(token_ids, logits):
        entered.set()
        release.wait(60)
        return logits

    return hold


def test_a_stream_nobody_reads_is_aborted_and_bounded(llama):
    with make_engine(llama, max_unread_tokens=8) as engine:
        rid = engine.add_request([5, 6, 7], long_params())
        stream = engine.stream(rid)  # attached, never read while it runs
        ok = engine.add_request([5, 6, 8], greedy(20))
        assert engine.get_result(ok, timeout=60).finish_reason in ("length", "eos")
        assert_no_leak(engine)  # the unread request is gone and its blocks are back
        assert engine.num_unread_aborts == 1
        (delta,) = list(stream)  # what was never read, merged into one delta
        assert delta.finished and delta.finish_reason == "aborted"
        assert "stopped reading" in delta.error
        assert 8 < len(delta.new_token_ids) <= 9 and delta.new_token_ids == delta.token_ids


def test_a_late_reader_gets_everything_in_one_delta(llama):
    prompt = [5, 9, 11, 30]
    expected = reference_greedy(llama, prompt, 30)
    with make_engine(llama) as engine:
        rid = engine.add_request(prompt, greedy(30))
        stream = engine.stream(rid)
        while rid in engine._registry:  # finished, settled into the unread stream
            engine.sync(timeout=30)
        (delta,) = list(stream)
        assert delta.finished and delta.new_token_ids == delta.token_ids == expected


def test_a_stale_stream_never_cancels_a_newer_request_with_its_id(llama):
    with make_engine(llama) as engine:
        rid = engine.add_request([5, 6, 7], greedy(3, ignore_eos=True), request_id="same")
        stale = engine.stream(rid)
        while "same" in engine._registry:
            engine.sync(timeout=30)
        engine.add_request([5, 6, 7], greedy(30, ignore_eos=True), request_id="same")
        stale.close()  # its request is done; the new one must not be touched
        del stale
        gc.collect()
        out = engine.get_result("same", timeout=60)
        assert out.finish_reason == "length" and len(out.token_ids) == 30
        assert_no_leak(engine)


def test_queue_bounds_refuse_with_overloaded_error(llama):
    release, entered = threading.Event(), threading.Event()
    hold = SamplingParams(
        max_new_tokens=2, logits_processors=[_blocking_processor(release, entered)]
    )
    with make_engine(llama, max_waiting_requests=2, max_queued_tokens=10) as engine:
        try:
            first = engine.add_request([5, 6, 7], hold)
            assert entered.wait(60)  # the loop is inside a step: nothing is published
            second = engine.add_request([5, 6, 8], greedy(2))
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
                engine.add_request([5, 6, 9], greedy(2))
            assert engine.num_queued == (2, 6)
        finally:
            release.set()
        engine.get_result(first, timeout=60)
        engine.get_result(second, timeout=60)
        assert engine.num_queued == (0, 0)
        # a single request longer than max_queued_tokens is taken when nothing waits
        big = engine.add_request(list(range(3, 20)), greedy(2))
        assert engine.get_result(big, timeout=60).finish_reason in ("length", "eos")
        assert engine.num_rejected == 1
        assert_no_leak(engine)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        EngineConfig(max_waiting_requests=0)


def test_request_timeout_finishes_it_with_what_it_has(llama):
    """The deadline passes mid-generation: the processor, run on the loop thread once a
    token exists, moves it into the past, so no machine is too slow or too fast for it."""
    records = {}

    def expire_after_the_first_token(token_ids, logits):
        if len(token_ids) > 3:  # the prompt's 3 tokens and at least one generated
            records["r"].deadline = time.monotonic() - 1
        return logits

    params = SamplingParams(
        max_new_tokens=400, ignore_eos=True, logits_processors=[expire_after_the_first_token]
    )
    with make_engine(llama) as engine:
        with hold_engine(engine):  # the record is found before the loop runs a step
            rid = engine.add_request([5, 6, 7], params, timeout=3600)
            records["r"] = engine._registry[rid]
        out = engine.get_result(rid, timeout=60)
        assert out.finish_reason == "timeout" and 1 <= len(out.token_ids) < 400
        with pytest.raises(ValueError, match="timeout"):
            engine.add_request([5, 6], greedy(2), timeout=0)
        assert_no_leak(engine)


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_reach_streams_and_results(llama):
    """The core's logprobs in every delta (merged when a stream falls behind), whole on the
    final output, and the same when a stream attaches late or the request is aborted."""
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with make_engine(llama) as engine:
        want = engine.get_result(engine.add_request(prompt, params), timeout=30)
        assert len(want.logprobs) == len(want.token_ids) == 8
        assert len(want.prompt_logprobs) == len(prompt) and want.prompt_logprobs[0] is None
        assert all(
            t in e and len(e) in (2, 3) for t, e in zip(want.token_ids, want.logprobs, strict=False)
        )
        # streamed: one entry per new token, the whole list on the last delta
        deltas = list(engine.stream(engine.add_request(prompt, params)))
        assert [e for d in deltas for e in d.new_logprobs] == want.logprobs
        assert deltas[-1].logprobs == want.logprobs
        assert all(d.prompt_logprobs == want.prompt_logprobs for d in deltas)
        # a stream attached after the request finished gets it all in one delta
        rid = engine.add_request(prompt, params)
        engine.sync(timeout=30)
        deadline = time.monotonic() + 30
        while engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.02)
        late = list(engine.stream(rid))
        assert [e for d in late for e in d.new_logprobs] == want.logprobs
        # cancelled: the logprobs published so far (none here), aligned with the tokens
        with hold_engine(engine):
            rid = engine.add_request(prompt, SamplingParams(max_new_tokens=400, logprobs=0))
            engine.cancel(rid)
        final = engine.get_result(rid, timeout=30)
        assert final.logprobs is not None and len(final.logprobs) == len(final.token_ids)
        off = engine.get_result(engine.add_request(prompt, greedy(2)), timeout=30)
        assert off.logprobs is None and off.new_logprobs is None and off.prompt_logprobs is None
        assert_no_leak(engine)
