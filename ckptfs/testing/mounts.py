"""Real kernel mounts for tests and reliability runs: one home for starting and taking down a
``ckptfs mount --foreground`` daemon (tests/conftest_mount.py and :mod:`ckptfs.testing.load`
both use it).

``start_mount`` waits until the kernel shows the mount (``os.path.ismount``, with a timeout);
``stop_mount`` always takes it down again, whatever state it is in: ``fusermount3 -u``, then a
lazy ``-uz``, then SIGKILL of the daemon.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time

from ckptfs.fs.daemon import cli_argv, fusermount, mount_entry

MOUNT_TIMEOUT_S = 60.0
CLI = cli_argv()


def fuse_available() -> bool:
    """True where this process can mount: /dev/fuse is usable and fusermount is installed."""
    return os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK) and fusermount() is not None


class Mount:
    """A running mount daemon (``proc``) serving ``region`` at ``path``; its output goes to
    ``log_path``."""

    def __init__(self, region: str, path: str, proc: subprocess.Popen, log_path: str):
        self.region, self.path, self.proc, self.log_path = region, path, proc, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def __truediv__(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def stop(self) -> None:
        stop_mount(self)


def start_mount(region: str, mountpoint: str, *args: str, timeout_s: float = MOUNT_TIMEOUT_S,
                cli: list[str] = CLI) -> Mount:
    """Start a foreground mount daemon and wait until the mount is up (or raise RuntimeError
    with its log); ``args``: more ``ckptfs mount`` arguments; ``cli``: the command that runs
    ``ckptfs`` (a script that registers a view first, say)."""
    os.makedirs(mountpoint, exist_ok=True)
    fd, log_path = tempfile.mkstemp(prefix="ckptfs-mount-", suffix=".log")
    proc = subprocess.Popen(cli + ["mount", "--foreground", "--region", region, *args, mountpoint],
                            stdin=subprocess.DEVNULL, stdout=fd, stderr=fd)
    os.close(fd)
    m = Mount(region, mountpoint, proc, log_path)
    deadline = time.monotonic() + timeout_s
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None:
            raise RuntimeError(f"the mount daemon exited with {proc.returncode}:\n{m.log()[-4000:]}")
        if time.monotonic() > deadline:
            log = m.log()
            stop_mount(m)
            raise RuntimeError(f"no mount at {mountpoint} after {timeout_s} s:\n{log[-4000:]}")
        time.sleep(0.05)
    return m


def force_unmount(mountpoint: str) -> None:
    """fusermount3 -u, then -uz if it is still there."""
    fm = fusermount()
    for flags in ("-u", "-uz"):
        if fm is None or mount_entry(mountpoint) is None:
            return
        subprocess.run([fm, flags, mountpoint], capture_output=True)


def stop_mount(m: Mount, wait_s: float = 10.0) -> None:
    """Unmount and make sure the daemon is gone, whatever state they are in."""
    fm = fusermount()
    if fm is not None and mount_entry(m.path) is not None:
        subprocess.run([fm, "-u", m.path], capture_output=True)
    try:
        m.proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass
    force_unmount(m.path)
    if m.proc.poll() is None:
        m.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable: the caller says so, it does not hang
            m.proc.wait(30)
    with contextlib.suppress(OSError):
        os.unlink(m.log_path)


@contextlib.contextmanager
def mounted(region: str, mountpoint: str, *args: str, cli: list[str] = CLI):
    """``start_mount`` for the ``with`` block, ``stop_mount`` after it, however it ends."""
    m = start_mount(region, mountpoint, *args, cli=cli)
    try:
        yield m
    finally:
        stop_mount(m)


def wait_unmounted(path: str, timeout_s: float = 20.0) -> bool:
    """True once ``path`` is no longer a mount point, False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not os.path.ismount(path):
                return True
        except OSError:  # ENOTCONN while a dead mount is being taken down
            pass
        time.sleep(0.05)
    return False
