"""The benchmark harness: workload definitions, metrics, process isolation, a --quick run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from conftest import random_prompts

from cbgen import EngineConfig, EngineCore, SpeculativeConfig
from cbgen.bench import metrics
from cbgen.bench.harness import parse_cpus, parse_engine_options, run_process
from cbgen.bench.peers import Peer
from cbgen.bench.report import speculation_line
from cbgen.bench.systems import run_cbgen
from cbgen.bench.workloads import build_workload, load_tokenizer, workload_names
from cbgen.cli import main
from cbgen.frontends.args.speculative import (
    add_speculative_arguments,
    build_speculative,
    describe,
    speculative_settings,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


# -- workloads -----------------------------------------------------------------------------


def test_all_named_workloads_are_defined():
    assert workload_names() == [
        "chat64",
        "short64",
        "long-prompt",
        "many-short",
        "shared-prefix",
        "grounded",
    ]


@pytest.mark.parametrize(
    ("name", "count", "new_tokens", "low", "high"),
    [
        ("chat64", 64, 128, 15, 600),
        ("short64", 64, 128, 18, 35),
        ("long-prompt", 16, 64, 2000, 4000),
        ("many-short", 256, 64, 10, 49),
        ("shared-prefix", 64, 64, 300, 1000),
        ("grounded", 12, 128, 100, 320),
    ],
)
def test_workload_counts_and_lengths(tokenizer, name, count, new_tokens, low, high):
    w = build_workload(name, tokenizer)
    lengths = w.prompt_lengths
    assert len(w.prompts) == count
    assert w.max_new_tokens == new_tokens
    assert low <= min(lengths) and max(lengths) <= high, (min(lengths), max(lengths))
    assert len({tuple(p) for p in w.prompts}) == count  # no duplicates
    assert w.num_output_tokens == count * new_tokens
    assert all(p[:3] == w.prompts[0][:3] for p in w.prompts)  # the chat template's start


def test_chat64_spreads_over_20_to_600_tokens(tokenizer):
    lengths = sorted(build_workload("chat64", tokenizer).prompt_lengths)
    assert lengths[0] <= 30 and lengths[-1] >= 450
    assert sum(n < 50 for n in lengths) >= 16 and sum(n > 200 for n in lengths) >= 10


def test_short64_is_about_25_tokens(tokenizer):
    lengths = build_workload("short64", tokenizer).prompt_lengths
    assert 22 <= sum(lengths) / len(lengths) <= 30


def test_long_prompts_spread_over_their_range(tokenizer):
    lengths = build_workload("long-prompt", tokenizer).prompt_lengths
    assert lengths == sorted(lengths)
    assert lengths[0] < 2200 and lengths[-1] > 3800


def test_shared_prefix_prompts_share_a_long_prefix(tokenizer):
    prompts = build_workload("shared-prefix", tokenizer).prompts
    common = os.path.commonprefix([tuple(p) for p in prompts])
    assert len(common) >= 600  # system prompt, instruction, 8 worked examples
    assert all(len(p) > len(common) for p in prompts)


def test_quick_variants_and_overrides(tokenizer):
    full = build_workload("chat64", tokenizer)
    quick = build_workload("chat64", tokenizer, quick=True)
    assert quick.quick and len(quick.prompts) < len(full.prompts)
    assert quick.max_new_tokens < full.max_new_tokens
    assert all(p in full.prompts for p in quick.prompts)
    assert max(quick.prompt_lengths) > 100  # spread over the set, not its first few
    small = build_workload("many-short", tokenizer, quick=True, num_prompts=3, max_new_tokens=2)
    assert (len(small.prompts), small.max_new_tokens) == (3, 2)
    # A definition's text names its own counts; a run that changes them says so.
    assert small.description.endswith("(as defined; run here with 3 prompts, 2 new tokens)")
    assert "run here" not in full.description
    held = build_workload("many-short", tokenizer, max_new_tokens=128)
    assert held.description == (
        "256 short prompts under 50 tokens, 64 new tokens "
        "(as defined; run here with 256 prompts, 128 new tokens)"
    )
    with pytest.raises(KeyError, match="unknown workload"):
        build_workload("nope", tokenizer)
    with pytest.raises(ValueError, match="64 prompts, 65 were asked"):
        build_workload("short64", tokenizer, num_prompts=65)


# -- metrics and plumbing ------------------------------------------------------------------


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert metrics.percentile(values, 50) == 2.5
    assert metrics.percentile(values, 0) == 1.0 and metrics.percentile(values, 100) == 4.0
    assert metrics.percentile(values, 99) == pytest.approx(3.97)
    assert metrics.percentile([], 50) is None


def test_summarize_one_run():
    run = {
        "wall_s": 2.0,
        "prompt_tokens": [10, 30],
        "output_tokens": [3, 3],
        "token_times": [[0.5, 0.6, 0.7], [1.0, 1.5, 2.0]],
    }
    figures = metrics.summarize(run)
    assert figures["output_tok_s"] == 3.0 and figures["prompt_tok_s"] == 20.0
    assert figures["ttft_p50_s"] == 0.75
    assert figures["itl_p50_ms"] == pytest.approx(300.0)
    assert set(figures) == set(metrics.METRICS)
    assert metrics.median_figures([run, {**run, "wall_s": 1.0}, {**run, "wall_s": 4.0}])[
        "wall_s"
    ] == pytest.approx(2.0)
    assert metrics.summarize({**run, "token_times": None})["ttft_p50_s"] is None


def test_options_parsing():
    assert parse_cpus("0-2,5") == [0, 1, 2, 5]
    assert parse_engine_options(["enable_prefix_caching=false", "scheduler_policy=fifo"]) == {
        "enable_prefix_caching": False,
        "scheduler_policy": "fifo",
    }


def test_cbgen_runs_on_a_reused_engine_start_with_an_empty_prefix_cache(llama):
    prompts = random_prompts(3, 20, 40, seed=5)
    config = EngineConfig(block_size=8)
    fresh = run_cbgen(llama, prompts, 5, config)
    assert fresh.setup_s is not None and 0 < fresh.setup_s < fresh.wall_s
    with EngineCore(llama, config) as engine:
        runs = [run_cbgen(llama, prompts, 5, config, engine) for _ in range(2)]
        # Without the reset the second run would take its prompts from the cache.
        assert engine.stats["cached_tokens"] == 0
    for run in runs:
        assert run.setup_s is None
        assert run.output_ids == fresh.output_ids
        assert all(len(times) == 5 for times in run.token_times)


def test_run_process_reports_each_childs_own_peak_rss(tmp_path):
    allocate = (
        "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1)"
    )
    env = dict(os.environ)
    big = run_process(
        [sys.executable, "-c", allocate],
        env=env,
        cpus=[],
        log_path=tmp_path / "big.log",
        timeout=60,
        max_rss_kib=None,
    )
    small = run_process(
        [sys.executable, "-c", "import time; time.sleep(1)"],
        env=env,
        cpus=[],
        log_path=tmp_path / "small.log",
        timeout=60,
        max_rss_kib=None,
    )
    assert big.returncode == 0 and small.returncode == 0
    assert big.peak_rss_kib > 300 * 1024 > small.peak_rss_kib


def test_run_process_kills_a_runaway(tmp_path):
    outcome = run_process(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env=dict(os.environ),
        cpus=[],
        log_path=tmp_path / "slow.log",
        timeout=0.5,
        max_rss_kib=None,
    )
    assert outcome.killed and "timed out" in outcome.killed and outcome.returncode != 0


def test_missing_peer_venv_says_how_to_create_it(tmp_path):
    (tmp_path / "peers").mkdir()
    (tmp_path / "peers" / "x_runner.py").write_text("")
    peer = Peer("x", "setup_x.sh", "x_runner.py", ".venv-x", "a note")
    message = peer.missing_message(tmp_path)
    assert "skipped" in message and "setup_x.sh" in message


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "chat64" in out and "shared-prefix" in out


# -- the harness end to end ----------------------------------------------------------------


def test_a_speculating_cbgen_run_reports_its_guesses(llama):
    prompts = [p + p for p in random_prompts(3, 6, 10, seed=5)]
    spec = SpeculativeConfig(method="layer_skip", num_layers=1)
    run = run_cbgen(llama, prompts, 12, EngineConfig(block_size=8, speculative=spec))
    counts = run.config["speculation"]
    assert counts["spec_proposed_tokens"] >= counts["spec_accepted_tokens"] >= 0
    assert counts["spec_verifications"] > 0
    assert run.config["engine_config"]["speculative"] == "layer_skip, k=4"
    json.dumps(run.config)  # the worker sends it back as JSON
    line = speculation_line({"systems": {"cbgen": {"config": run.config}}})[0]
    assert line.startswith("cbgen speculative decoding (layer_skip, k=4): ")
    assert f"{counts['spec_proposed_tokens']} guesses verified" in line


def test_speculative_flags_make_settings_a_worker_can_build():
    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    parser.add_argument("--model", default="smollm2")
    assert speculative_settings(parser.parse_args([])) is None
    args = parser.parse_args(["--speculative", "layer_skip", "--speculative-layers", "3"])
    settings = speculative_settings(args)
    assert describe(settings) == "layer_skip, k=4, 3 layers"
    assert build_speculative(json.loads(json.dumps(settings))).num_layers == 3
    args = parser.parse_args(["--speculative", "draft", "--draft-quantization", "int4"])
    assert describe(speculative_settings(args)) == "draft, k=4, draft smollm2 int4"
    with pytest.raises(ValueError, match="--draft-model"):
        speculative_settings(parser.parse_args(["--speculative", "draft"]))
    with pytest.raises(ValueError, match="num_tokens"):
        speculative_settings(
            parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "0"])
        )


def test_quick_bench_writes_json_markdown_and_chart(tmp_path):
    out = tmp_path / "run"
    # A separate interpreter, as a user runs it (each system in its own worker process).
    command = [
        sys.executable,
        "-m",
        "cbgen",
        "bench",
        "--quick",
        "--workload",
        "chat64",
        "--workload",
        "short64",
        "--systems",
        "cbgen,generate",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "4",
        "--isolation",
        "system",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cbgen ÷ generate" in done.stdout

    results = json.loads((out / "results.json").read_text())
    assert {"meta", "roofline", "workloads", "notes"} <= set(results)
    assert results["meta"]["quick"] and results["meta"]["repeats"] == 1
    roofline = results["roofline"]
    assert roofline["peak_flops"] > 0 and roofline["flops_per_token"] > 2 * 100e6
    assert {s["out"] for s in roofline["shapes"]} >= {576, 192, 1536, 49152}
    assert set(results["workloads"]) == {"chat64", "short64"}
    for workload in results["workloads"].values():
        assert workload["workload"]["num_prompts"] == 3
        assert set(workload["systems"]) == {"cbgen", "generate"}
        for system in workload["systems"].values():
            assert "error" not in system, system
            assert system["tokens_ok"] and system["output_tokens"] == 3 * 4
            assert set(system["median"]) == set(metrics.METRICS)
            assert system["median"]["output_tok_s"] > 0
            assert system["median"]["ttft_p50_s"] is not None
            assert system["peak_rss_mib"] > 100
            assert len(system["repeats"]) == 1
        assert workload["systems"]["generate"]["cbgen_ratio"] > 0
        assert workload["systems"]["cbgen"]["roofline"]["fraction"] > 0
    # both systems generated exactly the same number of tokens (EOS is ignored)
    counts = {
        name: system["output_tokens"]
        for workload in results["workloads"].values()
        for name, system in workload["systems"].items()
    }
    assert len(set(counts.values())) == 1

    md = (out / "results.md").read_text()
    assert "## chat64" in md and "## short64" in md and "## Summary" in md
    assert "| cbgen |" in md and "| generate |" in md and "Roofline:" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any("chart skipped" in note for note in results["notes"])
    else:
        assert (out / "throughput.png").stat().st_size > 1000


def test_the_roofline_of_a_quantized_run_times_the_dense_gemms(tiny_chat_model_dir):
    """A quantized model has no nn.Linear left; the roofline worker times the dense
    GEMMs of the run's dtype on the same shapes instead of failing on none."""
    from cbgen.bench.roofline import measure
    from cbgen.bench.worker import run_spec

    spec = {
        "kind": "roofline",
        "model": str(tiny_chat_model_dir),
        "dtype": "bfloat16",
        "quantization": "int8",
        "threads": 1,
        "roofline": {"m": 2, "min_time": 0.001},
    }
    roofline = run_spec(spec)["roofline"]
    assert roofline["peak_flops"] > 0 and roofline["shapes"]
    with pytest.raises(ValueError, match="no"):
        measure([])


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_the_bf16_roofline_times_a_onednn_gemm_giving_the_same_product(monkeypatch, onednn_bf16):
    """bfloat16 weights get oneDNN GEMMs in the roofline beside torch's ``F.linear``:
    oneDNN's packed bfloat16 where it packs it, and float32 on the widened weights
    everywhere (torch's bfloat16 GEMM is several times slower on AVX2-only CPUs, and
    the float32 units outrun vdpbf16ps on Intel's cores without AMX), and cbgen's
    float32-FMA kernel where it is built; each is the same product."""
    import torch

    from cbgen.bench import roofline
    from cbgen.executor.cpu.prepack import onednn_packs, prepack_supported

    if not prepack_supported():
        pytest.skip("this torch build has no oneDNN packed linear")
    if onednn_bf16 and not onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN packs no bfloat16 on this CPU")
    monkeypatch.setattr(
        roofline, "onednn_packs", lambda dtype: onednn_bf16 or dtype is not torch.bfloat16
    )
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    kernels = roofline._linear_kernels(w, 5)
    want = {"F.linear", "oneDNN prepacked, float32 (widened)"}
    if onednn_bf16:
        want.add("oneDNN prepacked")
    kernel_module = roofline.decode_kernel()
    if kernel_module is not None and kernel_module.bf16_fma_available():
        want.add("cbgen bf16_fma_matmul")
    assert set(kernels) == want
    exact = x.float() @ w.float().t()
    for kernel in kernels.values():
        torch.testing.assert_close(kernel(x).float(), exact, rtol=2**-7, atol=1e-5)
