"""The /proc readers: every one gives a real value on Linux and a neutral one elsewhere."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from cbgen import sysmem

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_memory_fields_are_read_in_kib():
    total, available = sysmem.meminfo_kib("MemTotal"), sysmem.meminfo_kib("MemAvailable")
    assert total is not None and available is not None and 0 < available <= total
    rss, hwm = sysmem.proc_status_kib("VmRSS"), sysmem.proc_status_kib("VmHWM")
    assert rss is not None and hwm is not None and 0 < rss <= hwm
    assert sysmem.proc_status_kib("VmRSS", os.getpid()) is not None
    assert sysmem.meminfo_kib("NoSuchField") is None
    assert sysmem.proc_status_kib("VmRSS", pid=2**31 - 1) is None  # no such process


@linux
def test_file_mappings_find_a_mapped_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x01" * (4 * mmap.PAGESIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        view = torch.frombuffer(mapped, dtype=torch.uint8)
        start = view.data_ptr()
        found = [m for m in sysmem.file_mappings() if m.start <= start < m.end]
        assert len(found) == 1 and found[0].path == str(path)
        assert found[0].inode == os.stat(path).st_ino and found[0].offset == 0
        page = mmap.PAGESIZE
        assert int(view[0]) == 1  # read: still the file's page
        assert sysmem.unmodified_file_pages(start, start + page, page)
        view[0] = 2  # a private copy now: no longer the file's page
        assert not sysmem.unmodified_file_pages(start, start + page, page)
        del view


@linux
def test_loaded_library_and_cpu():
    libc = sysmem.loaded_library("libc")
    assert libc is not None and os.path.basename(libc).startswith("libc")
    assert sysmem.loaded_library("libdoes-not-exist") is None
    assert sysmem.cpu_name() and sysmem.cpu_signature()
