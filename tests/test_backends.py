"""Tier 2: every backend runs the whole save / load / verify path."""
import pytest
import torch

import ckptfs
from ckptfs import _native
from ckptfs.region.backend import DevdaxBackend
from ckptfs.region.region import Region
from ckptfs.store import Store
from conftest import assert_same


@pytest.mark.skipif(not _native.pmem_available(), reason="libpmem1 is not installed")
def test_devdax_write_path_over_a_mapped_file(region_path):
    """The devdax backend (non-temporal copies + fence through libpmem) over a file mapping."""
    Region.format(region_path, 128 << 20).close()
    region = Region(region_path, backend=DevdaxBackend(region_path, writable=True))
    state = {"w": torch.randn(300, 300), "i": torch.arange(1000), "step": 4}
    with ckptfs.Writer(region, "dax", chunk_bytes=1 << 20) as w:
        for step in range(3):
            w.save(state, step=step).result()
    region.close()
    with Store(region_path) as s:  # read back through the ordinary file backend
        assert_same(state, s.load("dax"))
        assert s.verify() == []
        assert s.latest("dax").step == 2


def test_file_region_without_o_direct(tmp_path, monkeypatch):
    """Filesystems without O_DIRECT (tmpfs) fall back to buffered writes + fdatasync."""
    import os
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    p = str(tmp_path / "r")
    with ckptfs.Store.create(p, size_bytes=128 << 20) as s:
        with s.writer("m") as w:
            w.save({"a": torch.arange(100000)}, step=1).result()
        assert torch.equal(s.load("m")["a"], torch.arange(100000))


def test_msync_range_persists_a_mapped_range_and_checks_bounds(tmp_path):
    import mmap
    import os
    p = tmp_path / "f"
    p.write_bytes(bytes(3 * mmap.PAGESIZE))
    with open(p, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[mmap.PAGESIZE + 5:mmap.PAGESIZE + 8] = b"abc"
        _native.msync_range(m, mmap.PAGESIZE + 5, 3)  # an unaligned range: its page is synced
        assert os.pread(f.fileno(), 3, mmap.PAGESIZE + 5) == b"abc"
        with pytest.raises(ValueError, match="outside"):
            _native.msync_range(m, 2 * mmap.PAGESIZE, mmap.PAGESIZE + 1)
        with pytest.raises(ValueError, match="outside"):
            _native.msync_range(m, -1, 1)


def test_read_bytes_sees_o_direct_writes_and_checks_bounds(region_path):
    """Headers are read with pread (no page fault under the GIL); it must see what an O_DIRECT
    write just put there, and refuse ranges outside the region."""
    from ckptfs.region.backend import FileBackend, aligned_buffer
    Region.format(region_path, 64 << 20).close()
    backend = FileBackend(region_path, writable=True)
    try:
        before = backend.read_bytes(40 << 20, 4096)
        buf = aligned_buffer(4096)
        buf[:4] = b"\x01\x02\x03\x04"
        backend.write(40 << 20, buf)
        assert before == bytes(4096)
        assert backend.read_bytes(40 << 20, 6) == b"\x01\x02\x03\x04\x00\x00"
        with pytest.raises(ValueError, match="outside the region"):
            backend.read_bytes(backend.size_bytes - 2, 4)
    finally:
        backend.close()
