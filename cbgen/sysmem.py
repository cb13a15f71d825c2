"""Every reader of Linux's ``/proc`` in one place: memory, mappings, pages, the CPU;
and ``trim_heap``, which hands freed heap memory back to the OS; ``cache_dir``, where cbgen
keeps what it builds once per machine (converted models, native kernels).

Each returns a neutral value (``None``, empty, ``False``) where ``/proc`` is missing or
unreadable (macOS, a sandbox), so callers fall back instead of failing.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path
from typing import NamedTuple

import torch


class FileMapping(NamedTuple):
    """One memory-mapped file of this process: ``[start, end)`` maps ``path`` from ``offset``."""

    start: int
    end: int
    offset: int
    inode: int
    path: str


def _field_kib(path: str, field: str) -> int | None:
    """A ``Name:   123 kB`` field of a ``/proc`` file, in KiB."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: return the free parts of the heap to the OS. Large
    buffers freed after smaller ones (oneDNN's packed weights) stay in the process's
    resident set otherwise: ``EngineCore.sleep`` dropped 135 of SmolLM2's 540 MB of
    packed weights without it, all of them with it. False where there is no glibc."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def meminfo_kib(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemAvailable``, ``MemTotal``) in KiB, if readable."""
    return _field_kib("/proc/meminfo", field)


def proc_status_kib(field: str, pid: int | str = "self") -> int | None:
    """A ``/proc/<pid>/status`` memory field (``VmRSS``, ``VmHWM``) in KiB, if readable."""
    return _field_kib(f"/proc/{pid}/status", field)


def file_mappings() -> list[FileMapping]:
    """This process's memory-mapped files, from ``/proc/self/maps`` (empty elsewhere)."""
    mappings = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    mappings.append(
                        FileMapping(
                            int(start, 16),
                            int(end, 16),
                            int(fields[2], 16),
                            int(fields[4]),
                            fields[5],
                        )
                    )
    except OSError:
        return []
    return mappings


def loaded_library(prefix: str) -> str | None:
    """The path of a shared library already mapped into this process, by name prefix."""
    for mapping in file_mappings():
        name = os.path.basename(mapping.path)
        if name.startswith(prefix) and ".so" in name:
            return mapping.path
    return None


def unmodified_file_pages(start: int, end: int, page: int) -> bool:
    """Whether every resident page in [start, end) is still the file's own page.

    ``/proc/self/pagemap`` has one 64-bit entry per page: bit 63 says present, bit 61
    file-backed (a private copy made by a write is anonymous).
    """
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(start // page * 8)
            data = pagemap.read((end - start) // page * 8)
    except OSError:
        return False
    if len(data) != (end - start) // page * 8:
        return False
    entries = torch.frombuffer(bytearray(data), dtype=torch.int64)
    present = entries < 0  # bit 63
    file_backed = ((entries >> 61) & 1).bool()
    return bool((file_backed | ~present).all())


def cpu_signature() -> str:
    """The first CPU's model name and feature flags (Linux), else what ``platform`` knows."""
    wanted = ("model name", "flags", "features", "cpu model", "isa")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines: list[str] = []
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in wanted and line not in lines:
                    lines.append(line)
                elif not line.strip() and lines:
                    break  # the first processor's entry is enough
            if lines:
                return "".join(lines)
    except OSError:
        pass
    return platform.processor() or platform.platform()


def cpu_name() -> str:
    """The CPU's model name, else what ``platform`` knows."""
    for line in cpu_signature().splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where converted models live (``$CBGEN_CACHE_DIR``, else ``~/.cache/cbgen``)."""
    root = os.environ.get("CBGEN_CACHE_DIR") or Path.home() / ".cache" / "cbgen"
    return Path(root)
