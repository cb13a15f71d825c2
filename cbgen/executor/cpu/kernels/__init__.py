"""Optional native kernels, compiled on first use; pure-torch paths stand in when they can't be.

The paged decode attention kernel reads K/V straight from the block tables, once
per layer, instead of gathering a padded copy first; the layer ops (RMSNorm with
the residual add, rotary embedding of a fused q/k/v projection) serve the
decoder fast path (``cbgen.executor.cpu.fast_forward``); ``argmax_rows`` serves the greedy
sampler (``cbgen.sampling.sampler``). They are built with
``torch.utils.cpp_extension`` (needs a C++ compiler and ninja) into
``$CBGEN_CACHE_DIR/kernels/<machine key>``; a failed build is reported once and
the engine keeps running on the torch path. ``CBGEN_NO_KERNELS=1`` turns it off.

On x86-64 the kernel is compiled with ``-march=native`` (its SIMD paths need
AVX-512 or AVX2+FMA to be enabled at compile time), so the binary only runs on
CPUs with the builder's instruction sets. The build folder is therefore keyed by
the CPU's model and feature flags (and the torch version the binary links
against): a cache directory shared between machines rebuilds instead of
loading a binary that would die on an illegal instruction.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from ....sysmem import cpu_signature

logger = logging.getLogger(__name__)

# Compiled into one extension module; bindings.cpp declares what Python sees.
SOURCES = (
    "paged_decode.cpp",
    "layer_ops.cpp",
    "argmax.cpp",
    "int4_matmul.cpp",
    "routed_experts.cpp",
    "int8_matmul.cpp",
    "bf16_matmul.cpp",
    "bf16_fma_matmul.cpp",
    "quantize.cpp",
    "weight_watch.cpp",
    "layer_stack.cpp",
    "bindings.cpp",
)
# Included by the sources; part of the build key, so an edit rebuilds.
HEADERS = ("simd.h", "entry_points.h")

DISABLE_ENV = "CBGEN_NO_KERNELS"

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False
build_error: str | None = None  # why the build failed, for the test that requires it


def decode_kernel() -> ModuleType | None:
    """The compiled module, or None when native kernels are off or failed to build."""
    global _module, _failed, build_error
    if _module is not None or _failed:
        return _module
    if os.environ.get(DISABLE_ENV) == "1":
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _build()
            except Exception as exc:  # a missing compiler must not take the engine down
                _failed = True
                build_error = f"{type(exc).__name__}: {exc}"
                logger.warning("cbgen: native decode kernel unavailable (%s); using torch", exc)
    return _module


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    from ....sysmem import cache_dir

    here = Path(__file__).parent
    build_dir = cache_dir() / "kernels" / machine_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if not (build_dir / "cbgen_cpu_kernels.so").exists():
            # The first engine on a machine (or after an upgrade) waits for the compiler.
            logger.warning(
                "cbgen: building the native CPU kernels, once for this machine and version "
                "(about a minute); later runs load them from %s",
                build_dir,
            )
        return load(
            name="cbgen_cpu_kernels",
            sources=[str(here / name) for name in SOURCES],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an OS file lock on the build folder, released by the OS if the process dies.

    torch's ``load`` marks a build in progress with a ``lock`` file and makes every
    later loader wait until that file is gone; a process killed mid-build (a server
    stopped during its first start) leaves it behind, and every later start waited
    forever. Builders take this ``flock`` first, so whoever holds it knows no live
    cbgen build owns a ``lock`` file there: one left over is stale and is removed.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file only
        yield
        return
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("cbgen: removing %s, left by a kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_flags() -> list[str]:
    """``-march=native`` where the SIMD paths need it (x86-64); plain ``-O3`` elsewhere.

    ``-ffp-contract=off`` keeps the compiler from fusing a product and a sum into
    one FMA where the source rounds them separately: the layer ops reproduce
    transformers' arithmetic operation by operation.
    """
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")
    return flags


def machine_key(here: Path = Path(__file__).parent) -> str:
    """A short hash of what a ``-march=native`` binary depends on: CPU, flags, torch, and
    the sources themselves and where they are, so two checkouts sharing one cache
    directory keep a build each instead of rebuilding over each other in turn (torch's
    ``load`` rebuilds when the source paths it recorded differ, even for the same bytes:
    a clean clone's test run made the main checkout's next load wait two minutes)."""
    import torch

    sources = hashlib.sha256(b"".join((here / name).read_bytes() for name in SOURCES + HEADERS))
    parts = [
        platform.machine(),
        torch.__version__,
        " ".join(compile_flags()),
        cpu_signature(),
        sources.hexdigest(),
        str(here.resolve()),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
