"""Tensor parallelism: the shard plan, the shards' arithmetic, and the engine over gloo.

Exactness: the ranks' partial sums are added in another order than one GEMM adds them,
so logits differ from one process's in the last bits (checked below to 1e-5); greedy
output on these prompts is token-identical to ``model.generate()``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from architectures import build_config
from conftest import make_tiny_model, random_prompts, reference_greedy, run_until_done

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.executor.parallel.executor import TensorParallelError
from cbgen.executor.parallel.group import RankGroup
from cbgen.executor.parallel.placement import parse_cpulist, rank_cpus
from cbgen.executor.parallel.sharding import _head_spans, local_heads, plan_shards, shard_model
from cbgen.executor.parallel.shm_reduce import ShmAllReduce, create_file, shm_supported


def _moe_model(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(arch), dtype=torch.float32).eval()


def _model(arch: str) -> torch.nn.Module:
    if arch in ("mixtral", "qwen2_moe"):
        return _moe_model(arch)
    if arch == "llama-kv1":
        return make_tiny_model("llama", num_key_value_heads=1)
    if arch == "llama-bias":
        return make_tiny_model("llama", attention_bias=True, mlp_bias=True)
    return make_tiny_model(arch)


# -- the plan ---------------------------------------------------------------------------


def test_plan_splits_every_attention_and_mlp_block_of_llama():
    plan = plan_shards(make_tiny_model("llama"), 2)
    kinds = sorted(b.kind for b in plan.blocks)
    assert kinds == ["attention", "attention", "mlp", "mlp"]
    assert plan.replicated == {}
    attention = next(b for b in plan.blocks if b.kind == "attention")
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (4, 2, 16)
    assert local_heads(attention, 2) == (2, 1)
    assert "split 2 attention, 2 mlp blocks" in plan.describe()


def test_fewer_kv_heads_than_ranks_replicates_the_kv_head_each_rank_reads():
    plan = plan_shards(make_tiny_model("llama", num_key_value_heads=1), 2)
    attention = next(b for b in plan.blocks if b.kind == "attention")
    assert local_heads(attention, 2) == (2, 1)
    for rank in (0, 1):
        spans = _head_spans(attention, 2, rank)
        assert spans["q_proj"] == (rank * 32, rank * 32 + 32)
        assert spans["k_proj"] == spans["v_proj"] == (0, 16)  # the only K/V head


def test_blocks_that_do_not_split_stay_whole_with_the_reason():
    # Olmo2 normalises q and k over all heads at once: its attention stays whole.
    plan = plan_shards(make_tiny_model("olmo2"), 2)
    assert sorted(b.kind for b in plan.blocks) == ["mlp", "mlp"]
    assert all("colwise_gather_output" in why for why in plan.replicated.values())
    # Three ranks split neither 4 heads nor a width of 128.
    with pytest.raises(ValueError, match="cannot split any block of LlamaForCausalLM over 3"):
        plan_shards(make_tiny_model("llama"), 3)


def test_a_model_without_a_tp_plan_is_refused_by_name():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no tensor-parallel plan"):
        plan_shards(make_tiny_model("gpt2"), 2)
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        EngineCore(make_tiny_model("gpt2"), EngineConfig(tensor_parallel_size=2, num_blocks=8))


def test_a_quantized_model_is_refused_with_its_reason():
    from cbgen.executor.cpu.model_quantization import quantize_model

    model = make_tiny_model("llama").to(torch.bfloat16)
    quantize_model(model, "int4")
    with pytest.raises(ValueError, match="its maps are not all nn.Linear"):
        plan_shards(model, 2)


def test_moe_experts_split_their_intermediate_width():
    plan = plan_shards(_moe_model("mixtral"), 2)
    assert sorted(b.kind for b in plan.blocks) == ["attention"] * 2 + ["experts"] * 2


# -- the shards' arithmetic, two ranks as two threads of this process --------------------


def _sharded_logits(model: torch.nn.Module, world: int, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's logits of ``ids`` through its shard (the model's own eager forward)."""
    plan = plan_shards(model, world)
    store = RankGroup.listen(world, timeout_s=60)
    results: list[torch.Tensor | BaseException | None] = [None] * world

    def rank_main(rank: int) -> None:
        try:
            group = RankGroup(
                rank, world, store.port, torch.device("cpu"), store=store if rank == 0 else None
            )
            shard = shard_model(model, plan, rank, group.all_reduce)
            with torch.inference_mode():
                results[rank] = shard(input_ids=ids).logits
        except BaseException as exc:  # surfaced below
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


@pytest.mark.parametrize(
    "arch", ["llama", "llama-kv1", "llama-bias", "qwen3", "gemma2", "mixtral", "qwen2_moe"]
)
def test_shards_sum_to_the_whole_model(arch):
    model = _model(arch)
    model.set_attn_implementation("eager")
    ids = torch.tensor([random_prompts(1, 12, 12, seed=3)[0]])
    with torch.inference_mode():
        whole = model(input_ids=ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for logits in _sharded_logits(model, 2, ids):
        torch.testing.assert_close(logits, whole, atol=1e-5, rtol=1e-5)
    # The caller's model is left as it was.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- the engine over processes -----------------------------------------------------------

ENGINE_ARCHITECTURES = [
    "llama",
    "llama-kv1",
    "qwen2",
    "qwen3",
    "gemma2",
    "mistral-sliding",
    "mixtral",
    "qwen2_moe",
]


# The fast decoder now builds every one of them (the MoE blocks called whole).
FAST_ARCHITECTURES = set(ENGINE_ARCHITECTURES)


@pytest.mark.parametrize("arch", ENGINE_ARCHITECTURES)
def test_tp2_greedy_equals_generate(arch):
    """Chunked prefill (8-token steps) and preemption (20 blocks of 4) included."""
    model = _model(arch)
    prompts = random_prompts(5, 3, 14, seed=11)
    config = EngineConfig(tensor_parallel_size=2, block_size=4, num_blocks=20, max_batch_tokens=8)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with EngineCore(model, config) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        results = run_until_done(engine)
        stats = engine.executor.reduce_stats()
        fast = engine.executor.runner.fast_forward is not None
    # The fast decoder runs the rank's shard, with the all-reduces itself.
    assert fast == (arch in FAST_ARCHITECTURES)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert results[rid].token_ids == reference_greedy(model, prompt, 8), rid
    # One all-reduce per attention and per MLP block in every forward, on both ranks.
    assert stats[0][1] == stats[1][1] > 0


def test_tp2_with_swap_preemption_and_the_prefix_cache():
    model = make_tiny_model("llama")
    shared = random_prompts(1, 12, 12, seed=5)[0]
    prompts = [shared + p for p in random_prompts(4, 2, 6, seed=6)]
    config = EngineConfig(
        tensor_parallel_size=2,
        block_size=4,
        num_blocks=14,
        max_batch_tokens=16,
        preemption_mode="swap",
    )
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with EngineCore(model, config) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        results = run_until_done(engine)
        stats = dict(engine.stats)
    assert stats["cached_tokens"] > 0 and stats["swapped_in"] > 0
    for rid, prompt in zip(ids, prompts, strict=True):
        assert results[rid].token_ids == reference_greedy(model, prompt, 16)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


def test_a_dead_worker_fails_the_engine_clearly_and_nothing_is_left_behind():
    model = make_tiny_model("llama")
    engine = EngineCore(model, EngineConfig(tensor_parallel_size=2, num_blocks=32))
    pids = [p.pid for p, _ in engine.executor._workers]
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 6, 7], params)
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) died with exit code -9"):
        for _ in range(10):
            engine.step()
    # Every later call says the same, at once.
    with pytest.raises(TensorParallelError, match="died"):
        engine.step()
    engine.close()
    assert _alive(pids) == []


def test_close_ends_every_worker():
    engine = EngineCore(
        make_tiny_model("llama"), EngineConfig(tensor_parallel_size=2, num_blocks=8)
    )
    pids = [p.pid for p, _ in engine.executor._workers]
    assert _alive(pids) == pids
    engine.close()
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(pids) == []


def test_what_tensor_parallelism_refuses():
    with pytest.raises(ValueError, match="async_scheduling is not supported"):
        EngineConfig(tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="threads_per_rank"):
        EngineConfig(tensor_parallel_size=2, threads_per_rank=0)
    model = make_tiny_model("llama")
    with EngineCore(model, EngineConfig(tensor_parallel_size=2, num_blocks=8)) as engine:
        with pytest.raises(ValueError, match="LoRA adapters do not run under tensor parallel"):
            engine.executor.check_lora({})
        with pytest.raises(ValueError, match="not supported under tensor parallelism"):
            engine.update_weights({})


# -- placement ---------------------------------------------------------------------------


def test_as_many_ranks_as_numa_nodes_get_a_node_each(tmp_path, monkeypatch):
    from cbgen.executor.parallel import placement

    usable = placement.usable_cpus()
    halves = [usable[: max(1, len(usable) // 2)], usable[max(1, len(usable) // 2) :] or usable]
    for index, cpus in enumerate(halves):
        (tmp_path / f"node{index}").mkdir()
        (tmp_path / f"node{index}" / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
    monkeypatch.setattr(placement, "NODES", tmp_path)
    assert placement.numa_nodes() == halves
    assert placement.rank_cpus(2) == halves  # a node each
    assert placement.rank_cpus(2, threads_per_rank=1) == [[usable[0]], [usable[1 % len(usable)]]]
    assert len(placement.rank_cpus(3)) == 3  # not the node count: equal runs


def test_cpulists_and_rank_cores():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    cores = rank_cpus(2, threads_per_rank=1)
    assert [len(c) for c in cores] == [1, 1]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cores[0] != cores[1]


# -- through the server and `cbgen batch` ------------------------------------------------


def test_the_server_at_tp2_answers_as_tp1_and_503s_once_a_rank_dies():
    import httpx
    import openai
    import uvicorn
    from test_server import smollm2_tokenizer, tiny_model, uvicorn_in_thread

    from cbgen import Engine
    from cbgen.frontends.server import create_app

    tokenizer = smollm2_tokenizer()
    model = tiny_model(tokenizer)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    want = [reference_greedy(model, p, 8) for p in ids]
    engine = Engine(model, tokenizer, EngineConfig(tensor_parallel_size=2, num_blocks=64))
    app = create_app(engine, tokenizer, "tiny")
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    try:
        with uvicorn_in_thread(uv) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
            for prompt, expected in zip(ids, want, strict=True):
                reply = client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=8, temperature=0
                )
                text = tokenizer.decode(expected, skip_special_tokens=True)
                assert reply.choices[0].text == text
            assert httpx.get(f"{base}/health").status_code == 200
            worker = engine.core.executor._workers[0][0]
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
            with pytest.raises(openai.APIStatusError):  # the call in the failing step
                client.completions.create(model="tiny", prompt=ids[0], max_tokens=8)
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="tiny", prompt=ids[0], max_tokens=8)
            assert refused.value.status_code == 503
            assert "tensor-parallel rank 1" in str(refused.value)
            health = httpx.get(f"{base}/health")
            assert health.status_code == 503
            assert "died with exit code -9" in health.json()["error"]
    finally:
        engine.close()


def test_cbgen_batch_at_tp2_matches_generate_batch(tiny_chat_model_dir, tmp_path, capsys):
    from conftest import expected_token_ids, job_rows, write_jsonl

    from cbgen.cli import main
    from cbgen.frontends.jobs.files import read_rows

    rows = job_rows(6)
    write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["batch", "--model", str(tiny_chat_model_dir), "--input", str(tmp_path / "in.jsonl")]
    args += ["--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "5", "--no-progress"]
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    out = read_rows(tmp_path / "out.jsonl")
    assert [r["token_ids"] for r in out] == expected_token_ids(tiny_chat_model_dir, rows, 5)


DRIVER_SCRIPT = """
import signal, sys, torch
from transformers import LlamaConfig, AutoModelForCausalLM
from cbgen import EngineConfig, EngineCore, SamplingParams

if __name__ == "__main__":
    # Ctrl-C as in a terminal: a child inherits an ignored SIGINT, and the process
    # running the tests may ignore it (a pytest-xdist worker does).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with EngineCore(model, EngineConfig(tensor_parallel_size=2, num_blocks=64)) as engine:
        print(*[p.pid for p, _ in engine.executor._workers], flush=True)
        params = SamplingParams(max_new_tokens=10**6, temperature=0.0, ignore_eos=True)
        while True:  # until a signal: requests that never end
            engine.add_request([5, 6, 7], params)
            for _ in range(50):
                engine.step()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_no_worker_outlives_its_driver(tmp_path, sig):
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids) == pids
        driver.send_signal(sig)
        # Generous: the bound only keeps a regression from hanging the suite (an idle
        # 2-core machine exits in 1 to 2 s).
        driver.wait(120)
        deadline = time.monotonic() + 20
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(pids) == []
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in (driver.stderr.read() if driver.stderr else "")
    finally:
        driver.kill()
        driver.wait()


# -- the shared-memory all-reduce --------------------------------------------------------


@pytest.mark.skipif(not shm_supported(), reason="the shared-memory path is x86-64 only")
@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_all_reduce_gives_every_rank_the_same_sum(world):
    path = create_file(world, 1 << 16)
    assert path is not None
    try:
        ranks = [ShmAllReduce(path, r, world, 1 << 16, lambda: True, 60) for r in range(world)]
    finally:
        os.unlink(path)  # the mappings keep it
    generator = torch.Generator().manual_seed(0)
    calls = [
        [torch.randn(n, generator=generator, dtype=torch.float32) for _ in range(world)]
        for n in (1, 100, 4096, 3000)
    ] + [[torch.randn(64, 7, generator=generator).bfloat16() for _ in range(world)]]
    sums: list[list[torch.Tensor]] = [[] for _ in range(world)]

    def rank_main(rank: int) -> None:
        for parts in calls:  # alternating slots: consecutive calls must not collide
            tensor = parts[rank].clone()
            ranks[rank](tensor)
            sums[rank].append(tensor)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for index, parts in enumerate(calls):
        want = parts[0].float()
        for part in parts[1:]:
            want = want + part.float()
        for rank in range(world):
            assert torch.equal(sums[rank][index], sums[0][index])  # the same bits everywhere
            torch.testing.assert_close(sums[rank][index].float(), want, rtol=1e-2, atol=1e-2)
    assert not ranks[0].fits(torch.empty(1 << 15))  # 128 KiB: gloo's
    for r in ranks:
        r.close()


@pytest.mark.skipif(not shm_supported(), reason="the shared-memory path is x86-64 only")
def test_shared_memory_all_reduce_stops_waiting_for_a_peer_that_is_gone():
    path = create_file(2, 1 << 12)
    assert path is not None
    alone = ShmAllReduce(path, 0, 2, 1 << 12, lambda: False, 600)
    os.unlink(path)
    with pytest.raises(RuntimeError, match="peer process is gone"):
        alone(torch.ones(8))
    alone.close()


def test_a_model_another_engine_serves_can_be_split_too():
    """The other engine's forwards on the modules (prepacked maps) are closures: they
    stay off the workers' pickles and the shards' copies, and that engine runs on."""
    model = make_tiny_model("llama")
    prompts = random_prompts(3, 3, 10, seed=21)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with EngineCore(model, EngineConfig(num_blocks=32)) as single:
        assert any("forward" in m.__dict__ for m in model.modules())
        with EngineCore(model, EngineConfig(tensor_parallel_size=2, num_blocks=32)) as split:
            ids = [split.add_request(p, params) for p in prompts]
            results = run_until_done(split)
        one = [single.add_request(p, params) for p in prompts]
        alone = run_until_done(single)
    for rid, other, prompt in zip(ids, one, prompts, strict=True):
        want = reference_greedy(model, prompt, 6)
        assert results[rid].token_ids == alone[other].token_ids == want
