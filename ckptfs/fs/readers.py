"""Who reads a region through its mounts: the pins of files open in a mount are held by the
mount daemon (one process for every reader), so ``ckptfs status`` looks behind it at the processes
that have a file of the mount open or mapped (a ``torch.load(mmap=True)`` result keeps its file
mapped after the file is closed). Best effort, as ``ckptfs.region.holders``: other users'
processes need root. No pyfuse3."""
from __future__ import annotations

import os

from ckptfs.fs.names import LATEST, dirname_step
from ckptfs.mounttable import mount_points
from ckptfs.region.holders import command_of

MOUNT_COMMAND = "ckptfs-mount"  # the mount daemon's process name (/proc/PID/comm)


def mount_readers(region_path: str) -> dict[tuple[str, int | None], set[tuple[int, str]]]:
    """{(model, step): {(pid, command)}} of the processes with a version's file open or mapped
    in a mount of the region at ``region_path``; step None: a file opened through ``latest`` (the
    step it pins is the one latest named when it was opened)."""
    points = [p.rstrip("/") + "/" for p in mount_points(region_path)]
    out: dict[tuple[str, int | None], set[tuple[int, str]]] = {}
    if not points:
        return out
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        for target in _files_of(pid):
            point = next((p for p in points if target.startswith(p)), None)
            key = _version_of(target[len(point):]) if point else None
            if key is not None:
                out.setdefault(key, set()).add((pid, command_of(pid)))
    return out


def _files_of(pid: int) -> set[str]:
    """The paths of the files process ``pid`` has open or mapped."""
    files = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                files.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    files.add(fields[5].rstrip("\n"))
    except OSError:
        pass
    return files


def _version_of(relative: str) -> tuple[str, int | None] | None:
    """(model, step, None for latest) of a path inside a mount, or None outside any version."""
    parts = relative.split("/")
    for i, part in enumerate(parts[1:], 1):
        if part == LATEST:
            return "/".join(parts[:i]), None
        step = dirname_step(part)
        if step is not None:
            return "/".join(parts[:i]), step
    return None


def readers_behind_mounts(region_path: str, pinned: list[tuple[str, list[dict]]]) -> None:
    """Give each pin of ``pinned`` ((model, its pins as ``Store.status`` lists them)) that a
    mount daemon holds ``readers``: the processes with its files open or mapped in a mount of
    the region (``mount_readers``: /proc scanned once, only where a mount holds a pin). A file
    opened through ``latest`` is counted for the mount's pins of the model that no file opened by
    its step explains."""
    by_step = None
    for model, pins in pinned:
        for p in pins:
            if any(cmd == MOUNT_COMMAND for _, cmd in p["holders"]):
                by_step = mount_readers(region_path) if by_step is None else by_step
                p["readers"] = sorted(by_step.get((model, p["step"])) or by_step.get((model, None)) or ())
