"""Progress of saves in flight, published for other processes (``ckptfs status``).

Each writer process keeps one small JSON file per model in a per-region directory on tmpfs
(``/dev/shm/ckptfs-<region uuid>/``), replaced atomically at most a few times a second. Nothing
goes to the region: progress is advisory. A file whose process is gone (a writer killed) is
removed by the next reader of the board or the next writer that closes (``sweep``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading

from ckptfs.writer.threads import start_thread

MIN_INTERVAL_S = 0.25


def progress_dir(region_uuid: bytes) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"ckptfs-{region_uuid.hex()[:16]}")


class ProgressBoard:
    """The saves in flight of one writer: step -> (bytes persisted, bytes total).

    Updates only touch a dict; a publisher thread writes the file, at most once per
    ``MIN_INTERVAL_S`` and only after a change. Publishing from the persist workers instead
    (JSON, a file write and a rename per chunk and per commit) would hold the GIL in bursts
    that the training loop's thread waits behind."""

    def __init__(self, region_uuid: bytes, model: str):
        self._dir = progress_dir(region_uuid)
        # hashed: a 255-byte model name would make an over-long file name
        self._path = os.path.join(self._dir, f"{hashlib.sha1(model.encode()).hexdigest()}.{os.getpid()}.json")
        self._model = model
        self._saves: dict[int, list[int]] = {}
        self._changed = threading.Condition()
        self._dirty = False
        self._closed = False
        self._publisher: threading.Thread | None = None
        sweep_boards(self._dir)  # the files of writers SIGKILLed before (a job that is always preempted)

    def start(self, counter: int, step: int, total_bytes: int) -> None:
        with self._changed:
            self._saves[counter] = [step, 0, total_bytes]
            self._mark_dirty()

    def advance(self, counter: int, nbytes: int) -> None:
        """Count ``nbytes`` more persisted."""
        with self._changed:
            if counter in self._saves:
                self._saves[counter][1] += nbytes
                self._mark_dirty()

    def finish(self, counter: int) -> None:
        with self._changed:
            self._saves.pop(counter, None)
            self._mark_dirty()

    def close(self) -> None:
        """Stop publishing and remove the file, and the region's directory when no other
        writer's file is left in it (waits for a publish in progress)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            publisher = self._publisher
        if publisher is not None:
            publisher.join()
        try:
            os.unlink(self._path)
        except OSError:
            pass  # advisory, as in _publish
        sweep(self._dir)

    def _mark_dirty(self) -> None:
        """Caller holds ``_changed``."""
        if self._closed:
            return
        self._dirty = True
        if self._publisher is None:
            try:
                start_thread(self._publish_loop, "ckptfs-progress", self._record_publisher)
            except RuntimeError:  # no thread now (a process at its limit): advisory, so no save
                return            # fails for it; the next change tries again
        self._changed.notify_all()

    def _record_publisher(self, publisher: threading.Thread) -> None:
        self._publisher = publisher

    def _publish_loop(self) -> None:
        while True:
            with self._changed:
                while not self._dirty and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                self._dirty = False
                saves = [{"step": s, "persisted_bytes": done, "total_bytes": total}
                         for s, done, total in self._saves.values()]
            self._publish(saves)
            with self._changed:
                self._changed.wait_for(lambda: self._closed, MIN_INTERVAL_S)

    def _publish(self, saves: list[dict]) -> None:
        """Replace the file atomically (making its directory when it is missing)."""
        doc = {"model": self._model, "pid": os.getpid(), "saves": saves}
        tmp = f"{self._path}.tmp"
        try:
            try:
                f = open(tmp, "w")
            except FileNotFoundError:
                os.makedirs(self._dir, exist_ok=True)
                f = open(tmp, "w")
            with f:
                json.dump(doc, f)
            os.replace(tmp, self._path)
        except OSError:
            pass  # progress is advisory: never fail a save over it


def _pid_of(name: str) -> int | None:
    """The writer process of a board file name (``<model hash>.<pid>.json``, or its ``.tmp``)."""
    parts = name.removesuffix(".tmp").split(".")
    if len(parts) != 3 or parts[2] != "json" or not parts[1].isdigit():
        return None
    return int(parts[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's process (EPERM): alive
    return True


_BOARD_NAME = re.compile(r"ckptfs-[0-9a-f]{16}")
_swept_all = [False]


def sweep_boards(own: str) -> None:
    """``sweep`` the board ``own`` (a writer's region's), and at the first writer of this
    process every region's (a region deleted after its writer was SIGKILLed leaves its directory
    to nobody else: a directory per such region piled up in /dev/shm)."""
    sweep(own)
    if _swept_all[0]:
        return
    _swept_all[0] = True
    base = os.path.dirname(progress_dir(bytes(8)))
    try:
        names = [n for n in os.listdir(base) if _BOARD_NAME.fullmatch(n)]
    except OSError:
        return
    for name in names:
        sweep(os.path.join(base, name))


def sweep(directory: str) -> None:
    """Remove the board files of writer processes that are gone (SIGKILLed: they never closed),
    then the directory if nothing is left in it (a writer that publishes next makes it again)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid = _pid_of(name)
        if pid is not None and not _alive(pid):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass  # removed by another sweep meanwhile
    try:
        os.rmdir(directory)
    except OSError:
        pass  # a live writer's file is in it


def read_progress(region_uuid: bytes) -> list[dict]:
    """Saves in flight reported by live writer processes of this region (the files of writers
    that are gone are swept away)."""
    out = []
    directory = progress_dir(region_uuid)
    sweep(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
            os.kill(int(doc["pid"]), 0)
        except (OSError, ValueError, KeyError):
            continue  # gone, or being replaced
        for save in doc.get("saves", []):
            out.append({"model": doc["model"], "pid": doc["pid"], **save})
    return out
