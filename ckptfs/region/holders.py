"""Which processes hold a region's lock bytes: the readers pinning a version, the writers holding
a claim. OFD locks carry no owner (``/proc/locks`` says pid -1), but each open file description
lists its locks in ``/proc/PID/fdinfo/FD``: a scan of the processes this one may look at finds
them (for ``ckptfs status``; best effort, other users' processes need root)."""
from __future__ import annotations

import os


def holders_in_words(path: str, offset: int, this_process: bool = True) -> tuple[str, bool]:
    """(who holds lock byte ``offset`` of the region at ``path``: each as "COMMAND (pid N)", this
    one as "this process" where ``this_process``, or "another process" where none can be seen;
    whether this process alone holds it)."""
    pids = {(pid, command) for pid, command, _ in lock_holders(path).get(offset, [])}
    words = ["this process" if this_process and pid == os.getpid() else f"{command} (pid {pid})"
             for pid, command in sorted(pids)]
    return ", ".join(words) or "another process", {pid for pid, _ in pids} == {os.getpid()}


def lock_holders(path: str) -> dict[int, list[tuple[int, str, str]]]:
    """{lock byte offset: [(pid, command, "READ" or "WRITE"), ...]} of the region at ``path``."""
    st = os.stat(path)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    out: dict[int, list[tuple[int, str, str]]] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            continue
        seen = set()
        for fd in fds:
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    lines = [line for line in f if line.startswith("lock:") and want in line]
            except OSError:
                continue
            for line in lines:
                # lock:	1: OFDLCK ADVISORY  READ -1 fe:00:2146817 2199023255557 2199023255558
                # (the kernel merges adjacent bytes of one description into one range)
                fields = line.split()
                if fields[8] == "EOF" or int(fields[8]) - int(fields[7]) > 1 << 16:
                    continue
                kind = fields[4]
                for byte in range(int(fields[7]), int(fields[8]) + 1):
                    if (byte, kind) not in seen:
                        seen.add((byte, kind))
                        out.setdefault(byte, []).append((pid, command_of(pid), kind))
    return out


def command_of(pid: int) -> str:
    """The command name of process ``pid`` ("?" where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
