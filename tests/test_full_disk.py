"""A region on a real, small filesystem that runs full (a loop-mounted ext4; root, as in CI)."""
import contextlib
import errno
import os
import re
import shutil
import subprocess

import pytest
import torch

import ckptfs
from ckptfs.errors import CkptfsError, RegionFullError, RegionIOError
from ckptfs.region.backend import free_bytes
from conftest_mount import mounted, requires_fuse

MIB = 1 << 20


@contextlib.contextmanager
def loop_ext4(tmp_path, options: str = "loop"):
    """A 300 MiB ext4 filesystem, mounted through a loop device with ``options``."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("mounting a filesystem image needs root and mkfs.ext4")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(300 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-o", options, str(image), str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"no loop mount here: {mounted.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill_up(directory: str) -> None:
    """Write filler.bin in ``directory`` until its filesystem is full."""
    with open(os.path.join(directory, "filler.bin"), "wb") as f:
        while True:
            try:
                f.write(bytes(8 * MIB))
                f.flush()
            except OSError:
                return


@pytest.fixture
def small_fs(tmp_path):
    with loop_ext4(tmp_path) as mnt:
        yield mnt


def test_a_ring_that_does_not_fit_gives_back_what_it_took(small_fs, capsys):
    """A region larger than its filesystem: a model whose ring does not fit is refused with
    sizes a person reads, and the blocks allocated before the filesystem ran out are given
    back, so other programs there can still write and smaller saves still work. ``ckptfs
    status`` says that the filesystem cannot back the region's free space."""
    from test_cli import run

    path = os.path.join(small_fs, "r.region")
    with ckptfs.Store.create(path, size_bytes=1 << 30) as store:
        st = store.status()
        assert st["filesystem_free_bytes"] < 300 * MIB < st["unallocated_bytes"] <= st["region_bytes"]
        code, out, _ = run(capsys, "status", "--region", path)
        assert code == 0 and re.search(r"warning  the filesystem under the region has \d+\.\d MiB free for its "
                                       r"10\d\d\.\d MiB not yet allocated", out), out
        with store.writer("small") as w:
            w.save({"w": torch.ones(MIB // 4)}, step=1).result()
        before = free_bytes(small_fs)
        with store.writer("big") as w, pytest.raises(RegionFullError) as full:
            w.save({"w": torch.zeros(100 * MIB // 4)}, step=1)  # 4 slots of 110 MiB > what is free
        message = str(full.value)
        assert re.search(r"has \d+\.\d MiB free, and the new ring needs 4\d\d\.\d MiB; nothing was kept", message), message
        assert free_bytes(small_fs) >= before - 4 * MIB, "the failed reservation kept blocks"
        assert store.models() == ["small"]
        with open(os.path.join(small_fs, "other-program.bin"), "wb") as f:  # the space is there again
            f.write(bytes(64 * MIB))
            f.flush()
            os.fsync(f.fileno())
        with store.writer("small") as w:
            w.save({"w": torch.full((MIB // 4,), 2.0)}, step=2).result()
        assert store.load("small")["w"][0] == 2.0
        assert store.load("small", step=1)["w"][0] == 1.0


def test_a_filesystem_that_goes_read_only_under_a_running_writer(tmp_path):
    """ext4 with errors=remount-ro after an error (triggered through sysfs): the next save fails
    with the filesystem's EROFS in words, the writer closes, what was saved still loads, and the
    region opens again read-only with a clear refusal to save."""
    with loop_ext4(tmp_path, "loop,errors=remount-ro") as mnt:
        device = os.path.basename(subprocess.run(["findmnt", "-n", "-o", "SOURCE", mnt], capture_output=True,
                                                 text=True, check=True).stdout.strip())
        trigger = f"/sys/fs/ext4/{device}/trigger_fs_error"
        if not os.path.exists(trigger):
            pytest.skip("this kernel cannot trigger an ext4 error (no trigger_fs_error)")
        path = os.path.join(mnt, "r.region")
        with ckptfs.Store.create(path, size_bytes=200 * MIB) as store:
            w = store.writer("m")
            w.save({"w": torch.ones(MIB)}, step=1).result()
            with open(trigger, "w") as f:
                f.write("ckptfs test\n")
            with pytest.raises(RegionIOError) as failed:
                w.save({"w": torch.full((MIB,), 2.0)}, step=2).result()
            assert failed.value.errno == errno.EROFS and "remount it read-write" in str(failed.value)
            w.close()
            assert store.load("m")["w"][0] == 1.0 and store.latest("m").step == 1
        with ckptfs.Store(path) as again:
            assert not again.region.writable and again.load("m")["w"][0] == 1.0
            with pytest.raises(CkptfsError, match="Read-only file system"):
                again.writer("m")
        # the changes of the command line, each one line in words (they said "Bad file descriptor")
        for args in (["rm", "m", "1"], ["keep", "m", "1"], ["unkeep", "m", "1"], ["rm", "--all", "m"]):
            done = subprocess.run(["ckptfs", *args, "--region", path], capture_output=True, text=True, timeout=60)
            assert done.returncode == 1, (args, done.stderr)
            assert re.fullmatch(r"ckptfs: error: .*is open read-only \(Read-only file system\): it can be read, not "
                                r"changed; make its filesystem writable and run the command again\n", done.stderr), \
                (args, done.stderr)


@pytest.mark.fuse
@requires_fuse
def test_a_region_file_removed_under_a_writer_and_a_mount(tmp_path):
    """Saves are refused (they would go with the process), the mount and this process still
    read what was saved (the way to rescue it)."""
    path = str(tmp_path / "r.region")
    store = ckptfs.Store.create(path, size_bytes=64 * MIB)
    try:
        w = store.writer("m")
        w.save({"w": torch.ones(MIB // 4)}, step=1).result()
        with mounted(path, str(tmp_path / "mnt")) as m:
            os.unlink(path)
            with pytest.raises(RegionIOError, match="was removed while in use"):
                w.save({"w": torch.ones(MIB // 4)}, step=2).result()
            w.close()
            assert store.load("m")["w"][0] == 1.0
            got = torch.load(os.path.join(m.path, "m", "latest", "checkpoint.pt"), weights_only=True)
            assert got["w"][0] == 1.0
    finally:
        store.close()


@pytest.mark.fuse
@requires_fuse
def test_a_region_file_truncated_under_a_writer_and_a_mount(tmp_path):
    """No SIGBUS: the writer's next save and a load are refused with the sizes, the mount
    answers EIO for the damaged version and keeps running."""
    path = str(tmp_path / "r.region")
    store = ckptfs.Store.create(path, size_bytes=64 * MIB)
    try:
        w = store.writer("m")
        w.save({"w": torch.ones(MIB)}, step=1).result()
        with mounted(path, str(tmp_path / "mnt")) as m:
            os.truncate(path, 32 * MIB)
            with pytest.raises(RegionIOError, match="truncated to 32.0 MiB"):
                w.save({"w": torch.ones(MIB)}, step=2).result()
            w.close()
            with pytest.raises(RegionIOError, match="truncated"):
                store.load("m")
            with pytest.raises(OSError) as eio:
                open(os.path.join(m.path, "m", "latest", "checkpoint.pt"), "rb").read()
            assert eio.value.errno == errno.EIO
            assert os.listdir(os.path.join(m.path, "m"))  # the daemon is still there
    finally:
        store.close()


def test_mkfs_on_a_full_filesystem_says_it_is_full(small_fs, capsys):
    """The superblock and model table are written through the mapping: on a full filesystem
    that was a SIGBUS, reported as "the device reported a media error" at a temporary name."""
    from test_cli import run

    fill_up(small_fs)
    path = os.path.join(small_fs, "r.region")
    code, _, err = run(capsys, "mkfs", path, "--size", "1GiB")
    assert code == 1 and f"allocating the region's superblock and model table of {path} failed: No space left " \
        "on device; the filesystem is full: free space on it" in err, err
    assert sorted(os.listdir(small_fs)) == ["filler.bin", "lost+found"]  # no region, no temporary file


def test_cli_errors_on_full_and_read_only_filesystems_name_the_user_s_paths(tmp_path, capsys):
    """mkfs on a read-only filesystem named its temporary file (.r.region.formatting-PID-TID);
    export there named OUT.ckptfs-part, and on a full one named no file at all."""
    from test_cli import TOY_MODEL, make_toy_region, one_error_line, run

    region = str(tmp_path / "toy.region")
    make_toy_region(region)
    with loop_ext4(tmp_path, "loop,ro") as read_only:
        code, _, err = run(capsys, "mkfs", os.path.join(read_only, "r.region"), "--size", "64M")
        assert code == 1 and one_error_line(err) == f"ckptfs: error: Read-only file system: {read_only}/r.region"
        code, _, err = run(capsys, "export", "--region", region, TOY_MODEL, os.path.join(read_only, "out.pt"))
        assert code == 1 and one_error_line(err) == f"ckptfs: error: Read-only file system: {read_only}/out.pt"
    (tmp_path / "mnt").rmdir()
    with loop_ext4(tmp_path) as full:
        fill_up(full)
        code, _, err = run(capsys, "export", "--region", region, TOY_MODEL, os.path.join(full, "out/"))
        assert code == 1 and one_error_line(err).startswith(f"ckptfs: error: No space left on device: {full}/out/"), err
        assert sorted(os.listdir(full)) == ["filler.bin", "lost+found"]  # nothing half-written left


def test_a_region_truncated_while_a_save_writes_fails_that_save(tmp_path, monkeypatch):
    """The file cut short after the save claimed its slot (its check at the claim passed): the
    save was reported committed, its direct writes having made the file longer again."""
    from ckptfs.region.claim import Claim

    path = str(tmp_path / "r.region")
    write, cut = Claim.write, []

    def truncating(self, offset, buf):
        if self.step == 2 and not cut:
            os.truncate(path, 32 * MIB)
            cut.append(True)
        return write(self, offset, buf)
    with ckptfs.Store.create(path, size_bytes=64 * MIB) as store, store.writer("m") as w:
        w.save({"w": torch.ones(MIB // 4)}, step=1).result()
        monkeypatch.setattr(Claim, "write", truncating)
        with pytest.raises(RegionIOError, match="was truncated to .* while in use"):
            w.save({"w": torch.full((MIB // 4,), 2.0)}, step=2).result()
        assert cut and store.latest("m").step == 1
        os.truncate(path, 2 * MIB)  # past the slot headers: their reads fail too, and say why
        for listing in (store.versions, store.latest):
            with pytest.raises(RegionIOError, match="was truncated to 2.0 MiB while in use"):
                listing("m")


def test_limits_of_the_process_are_not_blamed_on_the_device(tmp_path):
    """Out of file descriptors or under a file-size limit (`ulimit -f`, set by some batch
    schedulers), a save said "check the device and the filesystem holding the region", and
    mkfs "larger than its filesystem allows" with the filesystem nearly empty."""
    import errno
    import resource

    from ckptfs.region.backend import io_step

    for code, advice in ((errno.EMFILE, "raise its limit (`ulimit -n`)"), (errno.ENFILE, "close some")):
        with pytest.raises(RegionIOError, match=re.escape(advice)), io_step("open for a writer", "r.region"):
            raise OSError(code, os.strerror(code))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (MIB, hard))
    try:
        with pytest.raises(ckptfs.errors.RegionFormatError,
                           match=re.escape("may write files up to 1.0 MiB (`ulimit -f`): raise that limit")):
            ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 * MIB)
        with pytest.raises(RegionIOError, match=re.escape("(`ulimit -f`)")), io_step("write", "r.region"):
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == []


def _writer_threads() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name.startswith(("ckptfs-persist", "ckptfs-progress")))


def test_a_writer_whose_opening_fails_leaves_no_thread_and_no_claim(store, monkeypatch):
    """An I/O error while a writer opens a model that has versions (reading its latest slot)
    reaches the caller, and nothing of that writer lives on: no worker waiting forever, no ring
    held, so the next writer opens as usual (the anomaly tests left 5 writers a run behind)."""
    with store.writer("m") as w:
        w.save({"w": torch.ones(8)}, step=1).result()
    before = _writer_threads()
    region = type(store.region)

    def failing_latest(self, entry):
        raise RegionIOError("reading a slot header failed", errno.EIO, "pread")
    with monkeypatch.context() as patch:
        patch.setattr(region, "latest", failing_latest)
        with pytest.raises(RegionIOError, match="slot header"):
            store.writer("m")
    assert _writer_threads() == before
    with store.writer("m") as w:
        w.save({"w": torch.full((8,), 2.0)}, step=2).result()
    assert torch.equal(store.load("m")["w"], torch.full((8,), 2.0))


def test_a_region_this_user_may_not_write_says_so(tmp_path, monkeypatch):
    """A region another user owns (mode 644) opens read-only; a save to it said "make its
    filesystem writable", where the file's permissions are the cause."""
    import errno

    path = str(tmp_path / "r.region")
    ckptfs.Store.create(path, size_bytes=64 * MIB).close()
    real_init = ckptfs.region.region.Region.__init__

    def as_another_user(self, p, writable=True, **kw):  # what open(2) answers a user who may not write
        if writable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        real_init(self, p, writable=writable, **kw)
    monkeypatch.setattr(ckptfs.region.region.Region, "__init__", as_another_user)
    with ckptfs.Store(path) as store:
        with pytest.raises(CkptfsError, match=r"is open read-only \(Permission denied\): it can be read, not saved "
                                              r"to; give this user write access to it \(its owner may: chmod, chown\), "
                                              r"or run as its owner, and open the store again"):
            store.writer("m")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 40 MiB tmpfs (no blocks reserved for root, as ext4 keeps: a root process sees more
    room than statvfs's f_bavail says)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], check=True)
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_checkpoint_that_grew_on_a_full_filesystem_is_not_told_to_unkeep(small_tmpfs):
    """A checkpoint grown past its slots (1 MiB -> 3 MiB) on a nearly full filesystem gets one
    larger slot; the next save was refused saying "every slot holds its latest or a kept
    version ... unkeep or remove a version of it" where none is kept: its other slots are too
    small, and only room on the filesystem helps."""
    small_fs = small_tmpfs
    path = os.path.join(small_fs, "r.region")

    def state(n):
        return {"model": {f"w{i}": torch.ones(256, 1024) for i in range(n)}}
    with ckptfs.Store.create(path, size_bytes=1 << 30) as store:
        with store.writer("m", max_inflight=3, timeout_s=10) as w:
            for s in range(5):
                w.save(state(1), step=s).result()
            st = os.statvfs(small_fs)
            with open(os.path.join(small_fs, "filler.bin"), "wb") as f:  # 4 MiB left
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 4 * MIB)
            w.save(state(3), step=5).result()  # one larger slot
            with pytest.raises(RegionFullError) as refused:
                w.save(state(3), step=6).result()
            said = str(refused.value)
            assert "grew past its older slots, and its one slot large enough holds its latest" in said, said
            assert "unkeep" not in said and "the filesystem holding" in said
        assert [v.step for v in store.versions("m")] == [1, 2, 3, 4, 5] and store.latest("m").step == 5
