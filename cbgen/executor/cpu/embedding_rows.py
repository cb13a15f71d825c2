"""Embedding lookups that keep only the rows in use resident.

Prepacking unmaps the float32 weights loaded from safetensors (``prepack.page_out``),
but the embedding table of a tied LM head is still read by every lookup. Mapped
back through the file, each row read brings its whole page-cache folio with it:
on this machine's kernel one 2.3 KB row mapped about 1.3 MB, and chat64's prompts
paged in about 100 MB of SmolLM2's 113 MB table. ``FileRows`` reads each row the
first time it is needed with ``pread`` (no mapping) into an anonymous table whose
untouched pages cost nothing, so the resident part is the rows used.
"""

from __future__ import annotations

import mmap
import os

import torch
import torch.nn.functional as F

from ...sysmem import file_mappings, unmodified_file_pages


class FileRows:
    """``F.embedding(ids, weight)`` for a ``weight`` that is an unmodified file mapping."""

    def __init__(self, weight: torch.Tensor, path: str, offset: int) -> None:
        self._rows, self._width = weight.shape
        self._row_bytes = self._width * weight.element_size()
        self._offset = offset
        self._fd = os.open(path, os.O_RDONLY)
        # torch.empty of this size is a fresh mapping: pages commit when a row is written.
        self._table = torch.empty_like(weight, memory_format=torch.contiguous_format)
        self._loaded = torch.zeros(self._rows, dtype=torch.bool)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        missing = ids[~self._loaded[ids]]
        if missing.numel():
            for row in missing.unique().tolist():
                data = os.pread(self._fd, self._row_bytes, self._offset + row * self._row_bytes)
                if len(data) != self._row_bytes:
                    raise OSError(f"short read of embedding row {row}")
                self._table[row] = torch.frombuffer(bytearray(data), dtype=self._table.dtype)
            self._loaded[missing] = True
        return F.embedding(ids, self._table)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def file_rows(weight: torch.Tensor) -> FileRows | None:
    """A ``FileRows`` over ``weight`` if ``rows_in_file`` finds it; else None (use the
    tensor)."""
    location = rows_in_file(weight)
    return FileRows(weight, *location) if location is not None else None


def rows_in_file(weight: torch.Tensor) -> tuple[str, int] | None:
    """The file and byte offset ``weight`` is read from, if it is a contiguous 2-D CPU
    tensor lying in one memory-mapped file and none of its pages was written; else None."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
        return None
    location = _file_location(weight)
    if location is None:
        return None
    page = mmap.PAGESIZE
    start = weight.data_ptr() // page * page
    end = -(-(weight.data_ptr() + weight.numel() * weight.element_size()) // page) * page
    return location if unmodified_file_pages(start, end, page) else None


def _file_location(tensor: torch.Tensor) -> tuple[str, int] | None:
    """The file and byte offset that the mapping holding ``tensor`` reads it from."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for mapping in file_mappings():
        if mapping.start <= start and end <= mapping.end:
            try:  # the file at that path now must be the one mapped
                same = os.stat(mapping.path).st_ino == mapping.inode
            except OSError:
                same = False
            return (mapping.path, mapping.offset + start - mapping.start) if same else None
    return None
