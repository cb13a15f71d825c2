"""Optional native kernels, compiled on first use; pure-torch paths stand in when they can't be.

The paged decode attention kernel reads K/V straight from the block tables, once
per layer, instead of gathering a padded copy first. It is built with
``torch.utils.cpp_extension`` (needs a C++ compiler and ninja) into
``$CBGEN_CACHE_DIR/kernels``; a failed build is reported once and the engine
keeps running on the torch path. ``CBGEN_NO_KERNELS=1`` turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def decode_kernel() -> ModuleType | None:
    """The compiled module, or None when native kernels are off or failed to build."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("CBGEN_NO_KERNELS") == "1":
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _build()
            except Exception as exc:  # a missing compiler must not take the engine down
                _failed = True
                logger.warning("cbgen: native decode kernel unavailable (%s); using torch", exc)
    return _module


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    from ..models import cache_dir

    source = Path(__file__).with_name("paged_decode.cpp")
    build_dir = cache_dir() / "kernels"
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name="cbgen_paged_decode",
        sources=[str(source)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
