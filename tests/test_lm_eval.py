"""lm-evaluation-harness against ``cbgen serve``: our own tiny tasks
(``tests/lm_eval_tasks/cbgen_tiny``) through lm-eval's ``local-completions`` model, and
the same loglikelihoods from lm-eval's own ``hf`` backend on the same model folder in
float32, compared item by item.

``LOGLIKELIHOOD_TOLERANCE``: what one item's summed continuation logprob may differ by.
Both sides run the same float32 weights; they differ only in kernels and batching
(cbgen's fast decoder and paged attention, transformers' eager forward), so the
differences are float32 rounding, measured at a few 1e-5 at most on these items.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")

import cbgen  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
MC, GEN = "cbgen_tiny_mc", "cbgen_tiny_gen"
LOGLIKELIHOOD_TOLERANCE = 1e-3


def server_load():
    """bench/server_load.py, for its server-starting helpers."""
    spec = importlib.util.spec_from_file_location("server_load", ROOT / "bench" / "server_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_folder() -> Path:
    try:
        cbgen.load_model("smollm2")  # converts the bundled model once
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled smollm2 model is not installed: {exc}")
    return cbgen.models.loader.cache_dir() / "smollm2"


def evaluate(model: str, model_args: dict, **kwargs):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[MC, GEN],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )


def logliks(results) -> dict[tuple[int, int], float]:
    """(doc, choice) -> the continuation's loglikelihood."""
    out = {}
    for sample in results["samples"][MC]:
        for choice, resp in enumerate(sample["resps"]):
            out[sample["doc_id"], choice] = float(resp[0][0])
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``python -m cbgen serve --model smollm2`` in a subprocess; its base URL."""
    folder = model_folder()
    helpers = server_load()
    port = helpers._free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "cbgen", "serve", "--model", "smollm2", "--port", str(port)]
    process = subprocess.Popen(command + ["--log-level", "warning"], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        helpers._wait_healthy(base, process, timeout=300)
        yield base, folder
    finally:
        helpers._stop_server(process)


@pytest.mark.slow
def test_lm_eval_local_completions_matches_hf(served, monkeypatch):
    base, folder = served
    monkeypatch.chdir(ROOT)  # the task files name their data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = evaluate(
        "local-completions",
        {
            "model": "smollm2",
            "base_url": f"{base}/v1/completions",
            "tokenizer": str(folder),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 2,
            "max_retries": 1,
        },
    )
    reference = evaluate(
        "hf", {"pretrained": str(folder), "dtype": "float32"}, device="cpu", batch_size=1
    )
    got, want = logliks(ours), logliks(reference)
    assert got.keys() == want.keys() and len(got) == 80
    worst = max(abs(got[k] - want[k]) for k in want)
    print(f"lm-eval loglikelihood: max |cbgen - hf| = {worst:.2e} over {len(want)} items")
    assert worst <= LOGLIKELIHOOD_TOLERANCE
    assert ours["results"][MC]["acc,none"] == reference["results"][MC]["acc,none"]
    # generate_until ran: the same greedy answers as transformers' generate
    generations = [s["resps"][0][0] for s in ours["samples"][GEN]]
    expected = [s["resps"][0][0] for s in reference["samples"][GEN]]
    print("generate_until:", generations)
    assert len(generations) == 10 and any(g.strip() for g in generations)
    assert generations == expected
    assert "exact_match,strip" in ours["results"][GEN]
