"""A region on a real, small filesystem that runs full (a loop-mounted ext4; root, as in CI)."""
import os
import re
import shutil
import subprocess

import pytest
import torch

import ckptfs
from ckptfs.errors import RegionFullError

MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    """A 300 MiB ext4 filesystem, mounted through a loop device."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("mounting a filesystem image needs root and mkfs.ext4")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(300 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"no loop mount here: {mounted.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_ring_that_does_not_fit_gives_back_what_it_took(small_fs):
    """A region larger than its filesystem: a model whose ring does not fit is refused with
    sizes a person reads, and the blocks allocated before the filesystem ran out are given
    back, so other programs there can still write and smaller saves still work."""
    path = os.path.join(small_fs, "r.region")
    with ckptfs.Store.create(path, size_bytes=1 << 30) as store:
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
