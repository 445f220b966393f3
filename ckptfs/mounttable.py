"""The system's table of mounts, as ckptfs reads it: where a path is mounted and what is, and
where a region is mounted (a ckptfs mount's source is its region's path). No pyfuse3: the CLI
and the region's formatting read it too."""
from __future__ import annotations

import os

FSTYPE = "fuse.ckptfs"  # the type of a ckptfs mount in /proc/self/mountinfo


def unescape(field: str) -> str:
    """Undo the octal escapes of /proc/self/mountinfo (``\\040`` for a space, ...)."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mountinfo(path: str) -> tuple[str, str, str] | None:
    """(device "major:minor", fstype, source) of the mount at ``path`` per /proc/self/mountinfo.

    Never touches ``path`` itself (only its parent directory): stat of a mount point would wait
    for the daemon, which may be the caller, or be dead."""
    path = os.path.abspath(path)
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) >= 5 and unescape(fields[4]) == path:
                    fstype, source = (right.split() + ["", ""])[:2]
                    found = (fields[2], fstype, unescape(source))  # the last one is the top of the stack
    except OSError:
        return None
    return found


def mount_points(region_path: str) -> list[str]:
    """The mount points of the ckptfs mounts of the region at ``region_path``."""
    real = os.path.realpath(region_path)
    points = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, (fstype, source) = left.split(), (right.split() + ["", ""])[:2]
                if len(fields) >= 5 and fstype == FSTYPE and os.path.realpath(unescape(source)) == real:
                    points.append(unescape(fields[4]))
    except OSError:
        pass
    return points
