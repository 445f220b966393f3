"""Tier 2: every backend runs the whole save / load / verify path."""
import pytest
import torch

import ckptfs
from ckptfs import _native
from ckptfs.errors import RegionFormatError
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


# ------------------------------------------------------------------ formatting guards
def test_create_refuses_a_non_empty_file_and_keeps_it(tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_bytes(b"do not lose me\n" * 100)
    with pytest.raises(RegionFormatError, match="not a ckptfs region.*force"):
        Store.create(str(precious), size_bytes=64 << 20)
    assert precious.read_bytes() == b"do not lose me\n" * 100
    empty = tmp_path / "empty"
    empty.touch()  # an empty file (e.g. from mktemp) holds nothing to lose
    with Store.create(str(empty), size_bytes=64 << 20) as s:
        assert s.models() == []
    with pytest.raises(RegionFormatError, match="is a directory"):
        Store.create(str(tmp_path), size_bytes=64 << 20)


def test_create_over_a_region_needs_force_and_then_erases_it(region_path):
    with Store.create(region_path, size_bytes=64 << 20) as s, s.writer("m") as w:
        w.save({"a": torch.ones(4)}, step=1).result()
    with pytest.raises(RegionFormatError, match="already holds a ckptfs region"):
        Region.format(region_path, 64 << 20)
    with Store.create(region_path, size_bytes=64 << 20, force=True) as s:
        assert s.models() == []


def test_concurrent_formats_of_one_path_leave_one_whole_region(tmp_path):
    """As when several ranks open the default region on first use at once."""
    import threading
    path = str(tmp_path / "shared.region")
    outcomes, barrier = [], threading.Barrier(4)

    def create():
        barrier.wait()
        try:
            Region.format(path, 64 << 20).close()
            outcomes.append("made")
        except RegionFormatError:
            outcomes.append("lost")
    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * 3 + ["made"]
    assert [f.name for f in tmp_path.iterdir()] == ["shared.region"]  # no temporary left behind
    with Store(path) as s:
        assert s.region.superblock.region_bytes == 64 << 20


# ------------------------------------------------------------------ a real block device
@pytest.fixture
def loop_device(tmp_path, request):
    """A loop device over a sparse file, of 128 MiB or of the size the test's ``loop_bytes``
    mark names (root and util-linux's losetup; CI has both)."""
    import os
    import shutil
    import subprocess
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("a loop device needs root and losetup")
    mark = request.node.get_closest_marker("loop_bytes")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(mark.args[0] if mark else 128 << 20)
    made = subprocess.run(["losetup", "--find", "--show", str(image)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"no loop device here: {made.stderr.strip()}")
    device = made.stdout.strip()
    try:
        yield device, image
    finally:
        subprocess.run(["losetup", "--detach", device], check=True)


@pytest.mark.loop_bytes(64 << 20)
def test_a_block_device_that_shrinks_under_a_writer_is_said_to_have_shrunk(loop_device):
    """An LV reduced, or a loop device re-read after its file was cut, under an open writer:
    saves went on into the part still there, then said "the filesystem is full" (there is none)
    or "the device reported an I/O error"; a file region cut short was already named so."""
    import os
    import subprocess

    from ckptfs.errors import RegionIOError

    device, image = loop_device
    with Store.create(device) as s:
        with s.writer("m") as w:
            w.save({"w": torch.ones(1 << 18)}, step=1).result()
            os.truncate(image, 8 << 20)
            subprocess.run(["losetup", "--set-capacity", device], check=True)
            with pytest.raises(RegionIOError, match=r"region's device .* shrank to 8\.0 MiB while in use"):
                w.save({"w": torch.ones(1 << 18)}, step=2).result()
        with pytest.raises(RegionIOError, match="shrank to"):
            s.load("m")


def test_block_device_region_round_trip(loop_device):
    device, _ = loop_device
    with pytest.raises(ValueError, match="takes all of it"):
        Store.create(device, size_bytes=64 << 20)
    state = {"w": torch.randn(256, 512), "ids": torch.arange(5000), "epoch": 2}
    with Store.create(device) as s:
        assert s.region.backend.kind == "block"
        assert s.region.superblock.region_bytes == 128 << 20
        with s.writer("blk", chunk_bytes=1 << 20) as w:
            for step in range(4):  # more saves than slots: the ring is reused
                state["w"].add_(1)
                w.save(state, step=step).result()
    with Store(device) as s:  # a fresh open reads what O_DIRECT wrote past the page cache
        assert_same(state, s.load("blk"))
        assert s.latest("blk").step == 3
        assert s.verify() == []


@pytest.mark.loop_bytes(8 << 20)
def test_a_device_too_small_for_a_region_is_refused_in_one_line(loop_device):
    device, _ = loop_device
    with pytest.raises(ValueError, match=r"holds 8\.0 MiB, too small for a region: it needs at least 64\.0 MiB"):
        Store.create(device)
    with open(device, "rb") as dev:
        assert dev.read(4096) == bytes(4096)  # nothing written


def test_block_device_holding_data_is_not_formatted(loop_device):
    device, image = loop_device
    label = b"\x53\xef" + b"an ext4 superblock, say"
    with open(device, "r+b") as dev:
        dev.seek(1080)
        dev.write(label)
        dev.flush()
        import os
        os.fsync(dev.fileno())
    with pytest.raises(RegionFormatError, match="not blank.*wipefs"):
        Store.create(device)
    with open(device, "rb") as dev:
        dev.seek(1080)
        assert dev.read(len(label)) == label
    with Store.create(device, force=True) as s:
        assert s.models() == []
