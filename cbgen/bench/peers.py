"""Peers: the same workloads through vLLM (CPU build) and llama.cpp, each in its own venv.

A peer runs ``bench/peers/<peer>_runner.py SPEC.json RESULT.json`` with the peer venv's
Python, reading the same spec as ``cbgen.bench.worker`` (token ids included) and writing
the same result, so the harness summarizes it like any other system. A peer whose venv is
missing is skipped with the command that creates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .workloads import bench_dir


@dataclass(frozen=True)
class Peer:
    name: str
    setup_script: str
    runner: str
    venv: str
    note: str

    def paths(self, root: Path | None = None) -> tuple[Path, Path, Path]:
        root = root or bench_dir()
        peers = root / "peers"
        return peers / self.venv / "bin" / "python", peers / self.runner, peers / self.setup_script

    def missing_message(self, root: Path | None = None) -> str | None:
        python, runner, setup = self.paths(root)
        if not runner.exists():
            return f"peer {self.name}: no runner at {runner}"
        if not python.exists():
            return (
                f"peer {self.name}: skipped, its virtual environment {python.parent.parent} is "
                f"missing; create it with `sh {setup}` ({self.note})"
            )
        return None


PEERS = {
    "vllm": Peer(
        "vllm",
        "setup_vllm.sh",
        "vllm_runner.py",
        ".venv-vllm",
        "vLLM's CPU build, several GiB of downloads",
    ),
    "llamacpp": Peer(
        "llamacpp",
        "setup_llamacpp.sh",
        "llamacpp_runner.py",
        ".venv-llamacpp",
        "llama-cpp-python built from source, about 8 minutes on 2 cores",
    ),
}
