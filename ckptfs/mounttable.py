"""The system's tables of mounts, as ckptfs reads them: where a path is mounted and what is,
where a region is mounted (a ckptfs mount's source is its region's path), and where /etc/fstab
expects a filesystem that is not there. No pyfuse3: the CLI, the Store and the region's
formatting read them too."""
from __future__ import annotations

import os

SUBTYPE = "ckptfs"  # libfuse's subtype= of a ckptfs mount
FSTYPE = "fuse." + SUBTYPE  # its type in /proc/self/mountinfo
FSTAB = "/etc/fstab"


def unescape(field: str) -> str:
    """Undo the octal escapes of /proc/self/mountinfo and /etc/fstab (``\\040`` for a space, ...)."""
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


def _mounts():
    """(device "major:minor", mount point, fstype, source) of every line of /proc/self/mountinfo,
    unescaped, in its order (a later mount at a point is on top of an earlier one)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5:
            fstype, source = (right.split() + ["", ""])[:2]
            yield fields[2], unescape(fields[4]), fstype, unescape(source)


def mountinfo(path: str) -> tuple[str, str, str] | None:
    """(device "major:minor", fstype, source) of the mount at ``path`` per /proc/self/mountinfo.

    Never touches ``path`` itself (only its parent directory): stat of a mount point would wait
    for the daemon, which may be the caller, or be dead."""
    path = os.path.abspath(path)
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    found = None
    for device, point, fstype, source in _mounts():
        if point == path:
            found = (device, fstype, source)  # the last one is the top of the stack
    return found


def mount_source(region_path: str) -> str:
    """The source (libfuse's ``fsname=``) of a ckptfs mount of the region at ``region_path``, as
    /proc/self/mountinfo shows it: its absolute path with each ',' made '_' (libfuse splits its
    options at commas, and fsname= is one of them)."""
    return os.path.abspath(region_path).replace(",", "_")


def is_mount_of(source: str, region_path: str) -> bool:
    """True where a ckptfs mount whose source is ``source`` serves the region at ``region_path``
    (mounted by that path, or by another that resolves to the same file)."""
    real = os.path.realpath(region_path)
    return source in (mount_source(region_path), mount_source(real)) or os.path.realpath(source) == real


def mount_points(region_path: str) -> list[str]:
    """The mount points of the ckptfs mounts of the region at ``region_path``."""
    return [point for _, point, fstype, source in _mounts() if fstype == FSTYPE and is_mount_of(source, region_path)]


def unmounted_fstab_point(path: str) -> str | None:
    """The directory above ``path`` that FSTAB names as a mount point where nothing is mounted
    now: the filesystem meant to hold ``path`` is missing (not mounted at a restart), and a file
    made there would land on the filesystem below. None otherwise (a directory made for a job is
    fine)."""
    try:
        with open(FSTAB) as f:
            points = {os.path.normpath(unescape(fields[1])) for fields in
                      (line.split() for line in f if not line.lstrip().startswith("#")) if len(fields) > 1}
    except OSError:
        return None
    d = os.path.dirname(os.path.abspath(path))
    while True:
        if d in points and d != "/" and os.path.isdir(d) and not os.path.ismount(d):
            return d
        if d == os.path.dirname(d):
            return None
        d = os.path.dirname(d)
