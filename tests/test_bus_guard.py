"""A region cut short between a check and an access: never SIGBUS, never zeros taken for data.

``check_present`` (an fstat before a save claims a slot or a version is opened) cannot close the
window in which the file is truncated after the check; the bus guard (native/busguard.c) does:
each test here makes the truncation land after the check, where it used to kill the process."""
import errno
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptfs
from ckptfs import _native
from ckptfs.errors import RegionFormatError, RegionIOError
from ckptfs.region.backend import DevdaxBackend
from ckptfs.region.region import Region
from conftest_mount import mounted, requires_fuse

MIB = 1 << 20
CUT_BYTES = 8192  # the superblock survives; the table, the slots and their data do not


def _region_with_a_version(path: str) -> ckptfs.Store:
    store = ckptfs.Store.create(path, size_bytes=64 * MIB)
    with store.writer("m") as w:
        w.save({"w": torch.arange(MIB // 4, dtype=torch.float32)}, step=1).result()
    return store


def test_a_read_through_the_mapping_after_the_file_was_cut(tmp_path):
    """First touch (checked against the CRC) and a copy of a tensor already checked: both give
    RegionIOError naming the truncation, and the zeros are never taken for the tensor."""
    path = str(tmp_path / "r.region")
    with _region_with_a_version(path) as store, store.open_version("m") as version:
        record = version.manifest.tensors[0]
        version.data.read(record.offset, record.nbytes)  # checked while the file is whole
        os.truncate(path, CUT_BYTES)
        copied = bytes(version.data.read(record.offset, record.nbytes))  # would have been SIGBUS
        assert copied == bytes(len(copied))  # what the guard puts there: zeros, never trusted ...
        with pytest.raises(RegionIOError, match=r"was truncated to 8\.0 KiB while in use"):
            version.data.confirm()  # ... because every consumer confirms before it keeps a copy
    with pytest.raises(RegionFormatError, match=r"is 8\.0 KiB but its superblock says 64\.0 MiB"):
        ckptfs.Store(path)


def test_a_mapping_closed_under_a_reader_takes_its_guard_with_it(tmp_path):
    """A store closed while a reader holds a view of its mapping: the mapping goes when the view
    does, and its guard with it, so the next region mapped at those addresses has its own faults
    seen (a guard left behind took them: a truncation went unreported)."""
    first = _region_with_a_version(str(tmp_path / "a.region"))
    with first.open_version("m") as version:
        held = version.read(0, 16)
    first.close()  # cannot unmap: `held` is a view of the mapping
    del held
    gc.collect()
    path = str(tmp_path / "b.region")
    with _region_with_a_version(path) as store, store.open_version("m") as version:
        record = version.manifest.tensors[0]
        version.data.read(record.offset, record.nbytes)
        os.truncate(path, CUT_BYTES)
        bytes(version.data.read(record.offset, record.nbytes))
        with pytest.raises(RegionIOError, match="truncated"):
            version.data.confirm()


def test_a_first_touch_after_the_cut_is_a_region_error_not_damage(tmp_path):
    path = str(tmp_path / "r.region")
    with _region_with_a_version(path) as store, store.open_version("m") as version:
        record = version.manifest.tensors[0]
        os.truncate(path, CUT_BYTES)
        with pytest.raises(RegionIOError, match="truncated") as cut:
            version.data.read(record.offset, record.nbytes)
        assert cut.value.errno == errno.EIO


def test_a_save_whose_check_passed_before_the_cut(tmp_path, monkeypatch):
    """The cut lands after the writer's check: the save fails with the region's error (its
    entry, read through the mapping, was zeros), and the process lives on."""
    path = str(tmp_path / "r.region")
    with _region_with_a_version(path) as store:
        w = store.writer("m")
        os.truncate(path, CUT_BYTES)
        monkeypatch.setattr(store.region.backend, "check_present", lambda **kw: None)  # the race
        with pytest.raises(RegionIOError, match="truncated"):
            w.save({"w": torch.ones(MIB // 4)}, step=2).result()
        monkeypatch.undo()
        w.close()  # no hang, nothing left claimed


@pytest.mark.skipif(not _native.pmem_available(), reason="libpmem1 is not installed")
def test_devdax_writes_through_a_mapping_whose_pages_are_gone(tmp_path, monkeypatch):
    """Devdax writes go through the mapping (libpmem): a page that cannot be written (here cut
    off; on a device, poisoned) fails the save with RegionIOError instead of SIGBUS, and nothing
    is published."""
    path = str(tmp_path / "dax.region")
    Region.format(path, 64 * MIB).close()
    region = Region(path, backend=DevdaxBackend(path, writable=True))
    state = {"w": torch.arange(MIB // 4, dtype=torch.float32)}
    w = ckptfs.Writer(region, "dax", chunk_bytes=MIB)
    w.save(state, step=1).result()
    size = os.path.getsize(path)
    entry = region.get("dax")
    os.truncate(path, entry.slot_offset(1))  # slot 0 (step 1) stays; the next slots are cut off
    monkeypatch.setattr(region.backend, "check_present", lambda **kw: None)
    durable = [1]
    with pytest.raises(RegionIOError, match="could not be read or written|truncated"):
        for step in range(2, 8):  # until a save's slot is in the part cut off
            w.save(state, step=step).result()
            durable.append(step)
    failed = durable[-1] + 1
    os.truncate(path, size)
    w.close()  # its workers end (the failed save's error was raised to its caller above)
    region.close()
    with ckptfs.Store(path) as s:  # what the region says now, through the file backend
        assert failed not in [v.step for v in s.versions("dax")]  # nothing half-written is visible


def test_a_fault_outside_every_region_still_ends_the_process(tmp_path):
    """The guard only answers for region mappings: any other SIGBUS keeps its usual outcome."""
    script = textwrap.dedent(f"""
        import mmap, os
        import ckptfs
        store = ckptfs.Store.create({str(tmp_path / 'r.region')!r}, size_bytes=64 << 20)
        p = {str(tmp_path / 'other.bin')!r}
        open(p, "wb").truncate(1 << 20)
        m = mmap.mmap(os.open(p, os.O_RDWR), 1 << 20)
        os.truncate(p, 0)
        print(m[900000])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -7, done.stderr  # SIGBUS, as without ckptfs


@pytest.mark.fuse
@requires_fuse
def test_the_mount_answers_eio_for_bytes_it_already_checked(tmp_path):
    """A file read whole through the mount (its tensors checked), then the region is cut and the
    kernel's copy dropped: the daemon answers EIO, not zeros, and keeps running."""
    path = str(tmp_path / "r.region")
    with _region_with_a_version(path), mounted(path, str(tmp_path / "mnt")) as m:
        fd = os.open(os.path.join(m.path, "m", "latest", "state.safetensors"), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            assert size > MIB and len(os.pread(fd, size, 0)) == size  # checked while whole
            os.truncate(path, CUT_BYTES)  # after the open's check: the daemon holds the version
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read goes to the daemon
            with pytest.raises(OSError) as eio:
                os.pread(fd, size, 0)
            assert eio.value.errno == errno.EIO
        finally:
            os.close(fd)
        assert os.path.isdir(m.path)  # the daemon is still there
