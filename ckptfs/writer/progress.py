"""Progress of saves in flight, published for other processes (``ckptfs status``).

Each writer process keeps one small JSON file per model in a per-region directory on tmpfs
(``/dev/shm/ckptfs-<region uuid>/``), replaced atomically at most a few times a second. Nothing
goes to the region: progress is advisory, and a file whose process is gone is ignored.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time

MIN_INTERVAL_S = 0.25


def progress_dir(region_uuid: bytes) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"ckptfs-{region_uuid.hex()[:16]}")


class ProgressBoard:
    """The saves in flight of one writer: step -> (bytes persisted, bytes total)."""

    def __init__(self, region_uuid: bytes, model: str):
        self._dir = progress_dir(region_uuid)
        # hashed: a 255-byte model name would make an over-long file name
        self._path = os.path.join(self._dir, f"{hashlib.sha1(model.encode()).hexdigest()}.{os.getpid()}.json")
        self._model = model
        self._saves: dict[int, list[int]] = {}
        self._mutex = threading.Lock()
        self._published = 0.0

    def start(self, counter: int, step: int, total_bytes: int) -> None:
        with self._mutex:
            self._saves[counter] = [step, 0, total_bytes]
        self._publish(force=True)

    def advance(self, counter: int, nbytes: int, force: bool = False) -> None:
        """Count ``nbytes`` more persisted; ``force`` publishes now (e.g. the last chunk)."""
        with self._mutex:
            if counter in self._saves:
                self._saves[counter][1] += nbytes
        self._publish(force)

    def finish(self, counter: int) -> None:
        with self._mutex:
            self._saves.pop(counter, None)
        self._publish(force=True)

    def close(self) -> None:
        try:
            os.unlink(self._path)
        except OSError:
            pass  # advisory, as in _publish

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._published < MIN_INTERVAL_S:
            return
        self._published = now
        with self._mutex:
            saves = [{"step": s, "persisted_bytes": done, "total_bytes": total}
                     for s, done, total in self._saves.values()]
        doc = {"model": self._model, "pid": os.getpid(), "saves": saves}
        try:
            os.makedirs(self._dir, exist_ok=True)
            tmp = f"{self._path}.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self._path)
        except OSError:
            pass  # progress is advisory: never fail a save over it


def read_progress(region_uuid: bytes) -> list[dict]:
    """Saves in flight reported by live writer processes of this region."""
    out = []
    directory = progress_dir(region_uuid)
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
