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
