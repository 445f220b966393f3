"""Mount lifecycle: serve a Store at a mount point, in the foreground or as a background daemon,
and unmount.

Background mounts (``ckptfs mount`` without ``--foreground``) start this same program in the
foreground in a new session (``start_new_session``, stdin/stdout on /dev/null) with an extra pipe,
the *ready fd*. The child mounts, then writes ``ok`` on the pipe — or one error line if it could
not mount — and only then detaches its stderr. The caller waits on the pipe, so every mount error
(missing region, bad mount point, kernel refusal) reaches the caller's terminal and exit status,
and ``ckptfs mount`` returns only once the mount is usable.

The daemon unmounts cleanly on SIGTERM, SIGINT and SIGHUP, and when the mount is unmounted from
outside (``ckptfs umount``, ``fusermount3 -u``); every pin it holds is released on the way out.
Unless ``auto_unmount=False``, libfuse's ``auto_unmount`` is used: fusermount3 watches the daemon
and unmounts if it dies (even by SIGKILL), so a dead daemon leaves no hung mount point behind.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable

from ckptfs.mounttable import FSTYPE, SUBTYPE, mount_source, mountinfo

log = logging.getLogger("ckptfs.fs")

READY = b"ok\n"
READAHEAD_KB = 4096  # kernel readahead of a mount (FUSE's default is 128 KiB)


class MountError(Exception):
    """The mount could not be made or undone; the message is one line for the user."""


# ------------------------------------------------------------------------------ mount table


def mount_entry(path: str) -> tuple[str, str] | None:
    """(fstype, source) of the mount at ``path`` per /proc/self/mountinfo, or None.

    Unlike ``os.path.ismount`` this also finds a mount whose daemon died ("Transport endpoint
    is not connected"), where ``stat`` fails."""
    info = mountinfo(path)
    return None if info is None else info[1:]


def set_readahead(mountpoint: str, kb: int) -> bool:
    """Set the kernel readahead of the mount's backing device info (root only; best effort).

    FUSE mounts start at 128 KiB, so a sequential reader gets 128 KiB requests, one after the
    other; a larger window lets the kernel send 1 MiB requests (max_pages) ahead of the reader,
    which roughly halves the time of a cold ``cp`` (tools/bench_read.py)."""
    info = mountinfo(mountpoint)
    if info is None:
        return False
    try:
        with open(f"/sys/class/bdi/{info[0]}/read_ahead_kb", "w") as f:
            f.write(str(kb))
        return True
    except OSError as exc:
        log.info("readahead of %s stays at the default: %s", mountpoint, exc)
        return False


def fusermount() -> str | None:
    """The path of fusermount3 (or fusermount), None where neither is installed."""
    return shutil.which("fusermount3") or shutil.which("fusermount")


def umount(mountpoint: str, *, lazy_fallback: bool = True) -> str:
    """Unmount a ckptfs mount: ``fusermount3 -u``, falling back to a lazy ``-uz`` when it is busy
    (the mount then goes away when its last user closes it). Returns "unmounted" or "detached".
    Raises MountError if nothing is mounted there or unmounting fails."""
    entry = mount_entry(mountpoint)
    if entry is None:
        raise MountError(f"{mountpoint} is not mounted")
    if entry[0] != FSTYPE:  # another FUSE filesystem (sshfs, ...) is not ours to take down
        raise MountError(f"{mountpoint} is a {entry[0]} mount, not ckptfs; use umount(8)")
    tool = fusermount()
    cmd = [tool, "-u"] if tool else ["umount"]
    r = subprocess.run(cmd + [mountpoint], capture_output=True, text=True)
    if r.returncode == 0:
        return "unmounted"
    first_error = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    if lazy_fallback:
        lazy = [tool, "-u", "-z"] if tool else ["umount", "-l"]
        r = subprocess.run(lazy + [mountpoint], capture_output=True, text=True)
        if r.returncode == 0:
            return "detached"
        first_error = (r.stderr.strip().splitlines() or [first_error])[-1]
    raise MountError(f"cannot unmount {mountpoint}: {first_error}")


# ------------------------------------------------------------------------------ serving


def check_mountpoint(mountpoint: str) -> None:
    """Refuse a mount point that does not exist, is not a directory, or is already mounted."""
    entry = mount_entry(mountpoint)
    if entry is not None:
        hint = "" if os.path.isdir(mountpoint) else " (its daemon is gone)"
        raise MountError(f"{mountpoint} is already mounted{hint}; unmount it first: ckptfs umount {mountpoint}")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} does not exist or is not a directory; "
                         f"create it first: mkdir -p {mountpoint}")


def fuse_options(store_path: str, *, allow_other: bool = False, auto_unmount: bool = True,
                 extra: Iterable[str] = ()) -> set[str]:
    """The libfuse options of a ckptfs mount.

    Read-only (``ro``: the kernel refuses every change) unless ``extra`` holds ``rw``, which
    allows one change: ``rm -r`` of a version that is not the latest (see ckptfs.fs.tree).
    ``default_permissions`` is off: the operations decide. With ``allow_other`` it is turned on,
    so that other users can read but only the owner (and root) can remove versions, per the
    directory modes; ``allow_other`` in ``extra`` (fstab's, the mount helper's spelling) is the
    same (without ``default_permissions`` any user could remove versions of a ``-o rw`` mount)."""
    extra = {o for o in extra if o}
    opts = {"fsname=" + mount_source(store_path), "subtype=" + SUBTYPE, "noatime"}
    if allow_other or "allow_other" in extra:
        opts |= {"allow_other", "default_permissions"}
    if auto_unmount:
        opts.add("auto_unmount")
    if "rw" not in extra:
        opts.add("ro")
    return opts | (extra - {"rw", "ro"})


def serve(store, mountpoint: str, *, allow_other: bool = False, auto_unmount: bool = True,
          extra_options: Iterable[str] = (), readahead_kb: int | None = READAHEAD_KB,
          views: Iterable[str] | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Mount ``store`` at ``mountpoint`` and serve it until unmounted or signalled.

    ``views``: the ids of the views whose files the mount shows (None: every registered view).
    ``on_ready`` is called once the mount answers (its root's ``stat``) and signal handling is in
    place. Raises MountError if mounting fails, also where libfuse ends the session at the
    kernel's INIT (a mount that exists but answers nothing). Always releases its pins and
    unmounts before returning."""
    import pyfuse3
    import trio

    from ckptfs.fs.ops import CkptfsOperations

    check_mountpoint(mountpoint)
    ops = CkptfsOperations(store, views=views)
    # What the daemon has made so far (its modules; torch's too, ~175,000 objects, where a
    # multi-rank version has loaded DCP) lives as long as it does: frozen out of the cyclic GC's
    # sight, a full collection stops traversing it (~0.1 s each with torch, and the first listing
    # of a version of 40,000 tensors starts several)
    gc.freeze()
    options = fuse_options(os.path.abspath(store.path), allow_other=allow_other, auto_unmount=auto_unmount,
                           extra=extra_options)
    mounted = False

    async def watch_signals(task_status=trio.TASK_STATUS_IGNORED):
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                log.info("%s: unmounting", signal.Signals(signum).name)
                pyfuse3.terminate()
                return

    async def apply_readahead():
        """Once the kernel has our INIT reply (which caps readahead at its 128 KiB proposal)."""
        with trio.move_on_after(10):
            while not ops.initialized:
                await trio.sleep(0.01)
            set_readahead(mountpoint, readahead_kb)

    async def reap_children():
        """With auto_unmount, libfuse leaves its fusermount3 child for us to reap."""
        for delay in (0.1, 1.0, 10.0):
            await trio.sleep(delay)
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                return

    async def serve_requests(ended: trio.Event):
        try:
            await pyfuse3.main()
        finally:
            ended.set()

    async def run():
        nonlocal mounted
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_signals)
            ended = trio.Event()
            with _stderr_captured() as said:
                try:
                    pyfuse3.init(ops, mountpoint, options)
                except RuntimeError as exc:
                    failure = exc
                else:
                    failure = None
                    mounted = True
                    nursery.start_soon(serve_requests, ended)
                    # up only once the kernel's INIT is answered and accepted: libfuse may still
                    # end the session there (a -o option it rejects), leaving a dead mount
                    answered = await _root_answers(mountpoint, ended)
            lines = [ln.strip() for ln in said().splitlines() if ln.strip()]
            if failure is None and not answered:
                failure = "the kernel and libfuse did not start the session"
            if failure is not None:  # returned, not raised: a nursery may wrap it in a group
                nursery.cancel_scope.cancel()
                return MountError(f"cannot mount {mountpoint}: {lines[-1] if lines else failure}")
            for line in lines:
                log.warning("%s", line)
            if readahead_kb:
                nursery.start_soon(apply_readahead)
            if on_ready is not None:
                on_ready()
            nursery.start_soon(reap_children)
            await ended.wait()
            nursery.cancel_scope.cancel()
        return None

    try:
        failure = trio.run(run)
        if failure is not None:
            raise failure
    finally:
        ops.close_all()
        if mounted:
            pyfuse3.close(unmount=True)


async def _root_answers(mountpoint: str, ended, timeout_s: float = 60.0) -> bool:
    """Whether the new mount answers a ``stat`` of its root, unless the session ``ended`` first
    or ``timeout_s`` passes. The stat is a child process's (``test -d``), never this process's:
    a thread of the daemon waiting on its own mount made the daemon unkillable where it was
    killed meanwhile (SIGKILL right after the mount, once in a CI run): the request waits for
    an answer only the daemon gives, and its /dev/fuse, whose closing would abort the request,
    stays open until every thread has ended."""
    import subprocess

    import trio

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            result = []

            async def probe():
                done = await trio.run_process(["/bin/sh", "-c", 'test -d "$0"', mountpoint], check=False,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                result.append(done.returncode == 0)
                nursery.cancel_scope.cancel()

            async def watch_end():
                await ended.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(probe)
            nursery.start_soon(watch_end)
        return bool(result) and result[0] and not ended.is_set()
    return False


@contextlib.contextmanager
def _stderr_captured():
    """Collect what C code (libfuse, fusermount3) writes on fd 2 meanwhile, so that its message
    becomes part of ours. Yields a callable returning the text (once the block has ended)."""
    text = ""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            raw = tmp.read()
            text = raw.decode(errors="replace")


def notify_systemd(state: bytes = b"READY=1") -> None:
    """sd_notify(3) without libsystemd: tell a ``Type=notify`` unit that the mount is up."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(state, addr)
    except OSError as exc:
        log.warning("cannot notify systemd: %s", exc)


def ready_signaller(ready_fd: int | None) -> Callable[[], None]:
    """What the foreground daemon calls once mounted: write ``ok`` on the ready fd (then detach
    stderr, so the waiting caller sees EOF on it) and notify systemd."""

    def ready() -> None:
        if ready_fd is not None:
            try:
                os.write(ready_fd, READY)
                os.close(ready_fd)
            except OSError:
                pass
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 2)
            os.close(devnull)
        notify_systemd()

    return ready


def report_failure(ready_fd: int | None, message: str) -> None:
    """Send one error line to a caller waiting on the ready fd."""
    if ready_fd is not None:
        try:
            os.write(ready_fd, ("error: " + message.replace("\n", " ") + "\n").encode())
        except OSError:
            pass


def spawn_background(argv: list[str], *, timeout: float = 120.0) -> None:
    """Start ``argv`` (a foreground mount command that accepts ``--ready-fd N``) as a daemon and
    wait until it reports the mount up. Raises MountError with the daemon's own message if it
    could not mount."""
    r, w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(argv + ["--ready-fd", str(w)], pass_fds=(w,), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err_w, start_new_session=True,
                                close_fds=True)
    finally:
        os.close(w)
        os.close(err_w)
    try:
        message, finished = _read_all(r, timeout)
        stderr = _read_all(err_r, 2.0)[0] if message != READY else b""
    finally:
        os.close(r)
        os.close(err_r)
    if message == READY:
        return
    text = message.decode(errors="replace").strip()
    if text.startswith("error: "):
        raise MountError(text[len("error: "):])
    proc.kill()
    code = proc.wait()
    if not finished:
        raise MountError(f"the mount daemon did not come up within {timeout:.0f} s; stopped it")
    tail = [ln for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    detail = tail[-1] if tail else f"exit status {code}"
    raise MountError(f"the mount daemon stopped before the mount was up: {detail}")


def _read_all(fd: int, timeout: float) -> tuple[bytes, bool]:
    """Read ``fd`` until EOF or ``ok``, at most ``timeout`` seconds: (data, whether it ended)."""
    import select

    deadline = time.monotonic() + timeout
    data = b""
    while data != READY:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return data, False
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    return data, True


def cli_argv() -> list[str]:
    """The command that runs this package's CLI in a child process: this interpreter's
    ``-m ckptfs.cli``, so that the child runs the ckptfs of this environment (whatever ``ckptfs``
    on PATH is)."""
    return [sys.executable, "-m", "ckptfs.cli"]
