"""Real kernel mounts for the tests (import what you need: ``from conftest_mount import ...``).

``mounted(region, mountpoint)`` starts ``ckptfs mount --foreground`` in a subprocess, waits until
the kernel shows the mount (``os.path.ismount``, with a timeout), and always takes it down again,
even when the test fails: ``fusermount3 -u``, then a lazy ``-uz``, then SIGKILL of the daemon.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

import pytest
import torch

import ckptfs
from ckptfs.fs.daemon import mount_entry

MOUNT_TIMEOUT = 60.0
CLI = [sys.executable, "-m", "ckptfs.cli"]
FUSERMOUNT = shutil.which("fusermount3") or shutil.which("fusermount")


def fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK) and FUSERMOUNT is not None


requires_fuse = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse and fusermount3")


class Mount:
    """A running mount daemon (``proc``) serving ``region`` at ``path``."""

    def __init__(self, region: str, path: str, proc: subprocess.Popen, log_path: str):
        self.region, self.path, self.proc, self.log_path = region, path, proc, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def __truediv__(self, rel: str) -> str:
        return os.path.join(self.path, rel)


def start_mount(region: str, mountpoint: str, *args: str, timeout: float = MOUNT_TIMEOUT,
                cli: list[str] = CLI) -> Mount:
    """Start a foreground mount daemon and wait until the mount is up (or raise with its log);
    ``cli``: the command that runs ``ckptfs`` (a script that registers a view first, say)."""
    os.makedirs(mountpoint, exist_ok=True)
    fd, log_path = tempfile.mkstemp(prefix="ckptfs-mount-", suffix=".log")
    proc = subprocess.Popen(cli + ["mount", "--foreground", "--region", region, *args, mountpoint],
                            stdin=subprocess.DEVNULL, stdout=fd, stderr=fd)
    os.close(fd)
    m = Mount(region, mountpoint, proc, log_path)
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None:
            raise RuntimeError(f"the mount daemon exited with {proc.returncode}:\n{m.log()}")
        if time.monotonic() > deadline:
            stop_mount(m)
            raise RuntimeError(f"no mount at {mountpoint} after {timeout} s:\n{m.log()}")
        time.sleep(0.05)
    return m


def force_unmount(mountpoint: str) -> None:
    """fusermount3 -u, then -uz if it is still there."""
    for flags in ("-u", "-uz"):
        if mount_entry(mountpoint) is None:
            return
        subprocess.run([FUSERMOUNT, flags, mountpoint], capture_output=True)


def stop_mount(m: Mount, wait: float = 10.0) -> None:
    """Unmount and make sure the daemon is gone, whatever state they are in."""
    if mount_entry(m.path) is not None:
        subprocess.run([FUSERMOUNT, "-u", m.path], capture_output=True)
    try:
        m.proc.wait(wait)
    except subprocess.TimeoutExpired:
        pass
    force_unmount(m.path)
    if m.proc.poll() is None:
        m.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable: the test says so, it does not hang
            m.proc.wait(30)
    with contextlib.suppress(OSError):
        os.unlink(m.log_path)


@contextlib.contextmanager
def mounted(region: str, mountpoint: str, *args: str, cli: list[str] = CLI):
    m = start_mount(region, mountpoint, *args, cli=cli)
    try:
        yield m
    finally:
        stop_mount(m)


# ------------------------------------------------------------------------------ a known region

TOY_MODEL = "toy"
TOY_STEPS = (100, 200, 300)


def toy_state(step: int) -> dict:
    """A deterministic checkpoint per step: several dtypes, nested optimizer state with int keys,
    plain leaves, and a 1 MiB tensor so that reads span many FUSE requests."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": OrderedDict(
            weight=torch.randn(64, 32, generator=g),
            bias=torch.randn(64, generator=g).to(torch.bfloat16),
            big=torch.randn(256, 1024, generator=g),
            ids=torch.randint(0, 1000, (16, 8), generator=g),
        ),
        "optim": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(64, 32, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "step": step,
        "name": "toy",
        "flags": (True, None, 1.5),
    }


def make_toy_region(path: str, steps=TOY_STEPS, model: str = TOY_MODEL) -> None:
    """A region holding ``model`` at ``steps`` (``toy_state``), the last one latest."""
    with ckptfs.Store.create(path, size_bytes=256 << 20) as store:
        w = store.writer(model)
        try:
            for s in steps:
                w.save(toy_state(s), s).result()
            w.wait()
        finally:
            w.close()
