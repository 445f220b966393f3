"""Lost-write crash emulation (in the spirit of PMDK's pmreorder and of ALICE).

1. :func:`record_scenario` runs a scripted workload -- several models, N saves in flight,
   out-of-order commits (injected write delays), a version removed, a model removed and a new one
   created in its ring -- against a region opened with a :class:`RecordingBackend`, and keeps the
   formatted region it started from.
2. :class:`CrashSim` replays the recording. After every event that changes what a crash could
   leave behind, it builds *crash images*: the starting region, plus every write that a completed
   barrier made durable, plus an arbitrary subset of the writes not yet durable -- each kept,
   dropped, or torn into 8-byte / 512-byte / 4 KiB pieces of which any subset survives -- plus,
   for every 8-byte word of the mapped metadata (model table), either its last persisted value or
   any value it held since (the kernel may write a dirty page of the mapping back at any moment
   before ``msync``; devdax may evict a cache line at any moment before the flush). Where the
   choices are few they are enumerated exhaustively, where they are many a random sample is drawn.
3. Each image is opened with the real code (``ckptfs.Store``) and checked (:func:`check_image`):
   the region opens; every model that had a completed save is there, and its latest is at least
   as new as the newest completed save; every listed version verifies and the latest loads to
   exactly what was saved at its step; removed things stay removed; a sample of images is also
   *continued* -- a new writer saves into the recovered region and that save becomes latest.

The crash model is that of a file-backed region (O_DIRECT writes + fdatasync barriers, msync for
the mapped metadata); docs/PERSISTENCE.md says why it also covers block devices and devdax.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import random
import shutil
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ckptfs.checksum import crc32
from ckptfs.region.region import Region
from ckptfs.store import Store
from ckptfs.testing.crashcheck import CHUNK_BYTES, Truth, check_image, continue_image
from ckptfs.testing.recording import (BarrierEnd, BarrierStart, Mark, MapChange, Persist,
                                      RecordingBackend, Write, WriteDone, copy_sparse)
from ckptfs.writer.writer import Writer

REGION_BYTES = 64 << 20
SLOT_BYTES = 256 << 10
TEAR_PIECES = (8, 512, 4096)


# ----------------------------------------------------------------------------------- scenario

def scenario_state(model: str, step: int):
    """The object saved as ``step`` of ``model``: even steps ~100 KiB (7 chunks), odd ones one
    chunk, so that a small save overtakes a big one that started before it."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{model}:{step}".encode()))
    n = 24_000 if step % 2 == 0 else 1_500
    return {
        "model": OrderedDict(w=torch.randn(n, generator=g),
                             b=torch.full((37,), float(step % 1000), dtype=torch.float16),
                             ids=torch.randint(0, 1 << 30, (5, 3), generator=g)),
        "optim": {"step": step, "lr": 0.1 / (step + 1), "name": model, 0: [step, None, True]},
    }


def store_on(region: Region) -> Store:
    """A Store around an already open Region (e.g. one with an injected backend)."""
    store = Store.__new__(Store)
    store.path = region.path
    store._region = region
    return store


@dataclass
class Recording:
    base_path: str        # the formatted region before the run
    events: list
    watch_bytes: int
    initial_words: np.ndarray
    expected: Callable = scenario_state
    stats: dict = field(default_factory=dict)


def _on_done(backend: RecordingBackend, model: str, step: int, fut) -> None:
    error = fut.exception()
    if error is None:
        r = fut.result()
        backend.mark("saved", model=model, step=step, counter=r.counter, published=r.published)
    else:
        backend.mark("save_failed", model=model, step=step, error=repr(error))


def record_scenario(workdir: str, seed: int = 0, steps: int = 6,
                    backend_cls: type = RecordingBackend) -> Recording:
    """Run the scripted workload on a fresh region under ``workdir``; see the module doc.

    ``backend_cls`` lets a test substitute a deliberately broken backend (one whose barriers
    are not barriers) to show that the emulator catches the resulting losses."""
    os.makedirs(workdir, exist_ok=True)
    region_path = os.path.join(workdir, "recorded.region")
    base_path = os.path.join(workdir, "base.region")
    for p in (region_path, base_path):
        if os.path.exists(p):
            os.unlink(p)
    Region.format(region_path, REGION_BYTES).close()
    copy_sparse(region_path, base_path)
    rng = random.Random(seed)

    def delay(offset: int, length: int) -> None:
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0, 0.004))

    backend = backend_cls(region_path, write_hook=delay)
    region = Region(region_path, backend=backend)
    store = store_on(region)
    geometry = dict(chunk_bytes=CHUNK_BYTES, slot_bytes=SLOT_BYTES)

    def save(w: Writer, model: str, step: int):
        backend.mark("save_start", model=model, step=step)
        fut = w.save(scenario_state(model, step), step)
        fut.add_done_callback(functools.partial(_on_done, backend, model, step))
        return fut

    try:
        writers = {"alpha": Writer(region, "alpha", max_inflight=2, slots=4, **geometry),
                   "beta": Writer(region, "beta", max_inflight=3, slots=5, **geometry)}
        for step in range(steps):
            for model, w in writers.items():
                save(w, model, step)
        for w in writers.values():
            w.wait()
        # remove one non-latest version
        old = [v for v in store.versions("alpha") if not v.latest]
        if old:
            backend.mark("remove_version_start", model="alpha", step=old[0].step)
            store.remove("alpha", old[0].step)
            backend.mark("remove_version_done", model="alpha", step=old[0].step)
        # a model that lives and dies, then a new one in its ring
        with Writer(region, "gamma", max_inflight=2, slots=3, **geometry) as g:
            for step in range(2):
                save(g, "gamma", step)
        backend.mark("remove_model_start", model="gamma")
        store.remove_model("gamma")
        backend.mark("remove_model_done", model="gamma")
        with Writer(region, "delta", max_inflight=2, slots=3, **geometry) as d:
            for step in range(steps, steps + 3):
                save(writers["alpha"], "alpha", step)
                save(d, "delta", step)
        # a milestone kept (its header rewritten), readers holding versions while saves go on (the
        # model takes slots from free space, then gives them back: entry updates), and a model that
        # outgrows its first save's slots (an extent of larger slots)
        beta = writers["beta"]
        beta.wait()
        store.keep("beta", store.latest("beta").step)
        pins = [store.open_version("beta", v.step) for v in store.versions("beta") if not v.kept][:2]
        for step in range(20, 23):
            save(beta, "beta", step)
        beta.wait()
        for pin in pins:
            pin.close()
        for step in range(23, 29):
            save(beta, "beta", step)
        with Writer(region, "epsilon", max_inflight=2, slots=3, chunk_bytes=CHUNK_BYTES) as e:
            for step in (1, 2, 3, 4, 6):
                save(e, "epsilon", step)
        for w in writers.values():
            w.close()
    finally:
        region.close()
    events = backend.events
    marks = [e for e in events if isinstance(e, Mark)]
    failed = [e.info for e in marks if e.kind == "save_failed"]
    if failed:
        raise AssertionError(f"saves failed during the recorded run: {failed}")
    stats = backend.summary()
    stats["out_of_order_commits"] = sum(1 for e in marks if e.kind == "saved" and not e.info["published"])
    stats["saves"] = sum(1 for e in marks if e.kind == "saved")
    return Recording(base_path, events, backend.watch_bytes, backend.initial_words, scenario_state, stats)


# ----------------------------------------------------------------------------------- replay

KEEP, DROP = "keep", "drop"


@dataclass
class CrashSimReport:
    crash_points: int = 0
    crash_points_tested: int = 0
    exhaustive_points: int = 0
    sampled_points: int = 0
    images: int = 0
    torn_images: int = 0
    continued: int = 0
    max_pending_writes: int = 0
    max_pending_words: int = 0
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    def merge(self, other: "CrashSimReport") -> None:
        for k in ("crash_points", "crash_points_tested", "exhaustive_points", "sampled_points", "images",
                  "torn_images", "continued"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.max_pending_writes = max(self.max_pending_writes, other.max_pending_writes)
        self.max_pending_words = max(self.max_pending_words, other.max_pending_words)
        self.failures += other.failures
        self.seconds += other.seconds


class CrashSim:
    """Replays a :class:`Recording` and checks crash images (see the module doc).

    ``exhaustive_limit``: enumerate every keep/drop x word-value combination at a crash point when
    there are at most this many; otherwise draw ``samples`` random images. ``tears``: extra images
    per point with torn writes. ``max_points``: test at most this many crash points (a random
    subset, always including each point just before a barrier completes). ``continue_every``:
    every n-th image is also continued with a new save (0: never).
    """

    def __init__(self, rec: Recording, workdir: str, *, seed: int = 0, exhaustive_limit: int = 16,
                 samples: int = 8, tears: int = 3, max_points: int | None = None,
                 continue_every: int = 25, max_failures: int = 20, keep_failed: bool = False):
        self.rec = rec
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.exhaustive_limit = exhaustive_limit
        self.samples = samples
        self.tears = tears
        self.max_points = max_points
        self.continue_every = continue_every
        self.max_failures = max_failures
        self.keep_failed = keep_failed

    # -- state of the replay
    def _reset(self) -> None:
        self.image = os.path.join(self.workdir, "crash.image")
        copy_sparse(self.rec.base_path, self.image)
        self.fd = os.open(self.image, os.O_RDWR)
        self.pending: "OrderedDict[int, Write]" = OrderedDict()
        self.covers: dict[int, frozenset] = {}
        self.durable_words = self.rec.initial_words.copy()
        self.current_words = self.rec.initial_words.copy()
        self.word_values: dict[int, list[int]] = {}  # word -> values held since its last persist
        self.truth = Truth()

    def _apply(self, ev) -> bool:
        """Advance the replay by one event; True if a crash right after it is a new state."""
        if isinstance(ev, Write):
            self.pending[ev.id] = ev
            return True
        if isinstance(ev, BarrierStart):
            self.covers[ev.id] = ev.covers
            return False
        if isinstance(ev, BarrierEnd):
            ids = sorted(wid for wid in self.covers.pop(ev.id) if wid in self.pending)
            for wid in ids:  # (a concurrent barrier that ended first may have covered some)
                w = self.pending.pop(wid)
                os.pwrite(self.fd, w.data, w.offset)
            return bool(ids)
        if isinstance(ev, MapChange):
            for word, value in ev.changes:
                self.current_words[word] = value
                self.word_values.setdefault(word, []).append(value)
            return True
        if isinstance(ev, Persist):
            first = ev.offset // 8
            last = min(-(-(ev.offset + ev.length) // 8), len(self.current_words))
            for word in range(first, last):
                value = int(self.current_words[word])
                if value != self.durable_words[word]:
                    self.durable_words[word] = value
                    os.pwrite(self.fd, value.to_bytes(8, "little"), word * 8)
                self.word_values.pop(word, None)
            return True
        if isinstance(ev, Mark):
            self.truth.apply(ev)
            return ev.kind not in ("save_start",)
        assert isinstance(ev, WriteDone), ev
        return False

    def _pending_words(self) -> list[tuple[int, list[int]]]:
        out = []
        for word, values in sorted(self.word_values.items()):
            cands = [int(self.durable_words[word])]
            for v in values:
                if v not in cands:
                    cands.append(v)
            if len(cands) > 1:
                out.append((word, cands))
        return out

    # -- images
    def _images(self, writes: list[Write], words: list) -> tuple[list, bool]:
        """A list of (write actions, word values) to test, and whether it is exhaustive."""
        combos = (2 ** len(writes)) * math.prod(len(c) for _, c in words)
        images = []
        if combos <= self.exhaustive_limit:
            for acts in itertools.product((KEEP, DROP), repeat=len(writes)):
                for vals in itertools.product(*[c for _, c in words]):
                    images.append((list(acts), list(vals)))
            exhaustive = True
        else:
            images.append(([DROP] * len(writes), [c[0] for _, c in words]))
            images.append(([KEEP] * len(writes), [c[-1] for _, c in words]))
            for _ in range(self.samples):
                acts = [self.rng.choice((KEEP, KEEP, DROP, DROP, "tear")) for _ in writes]
                images.append(([self._tear(w) if a == "tear" else a for w, a in zip(writes, acts)],
                               [self.rng.choice(c) for _, c in words]))
            exhaustive = False
        tearable = [i for i, w in enumerate(writes) if len(w.data) > TEAR_PIECES[0]]
        for _ in range(self.tears if tearable else 0):
            acts = [self.rng.choice((KEEP, DROP)) for _ in writes]
            i = self.rng.choice(tearable)
            acts[i] = self._tear(writes[i])
            images.append((acts, [self.rng.choice(c) for _, c in words]))
        return images, exhaustive

    def _tear(self, w: Write):
        sizes = [p for p in TEAR_PIECES if p < len(w.data)] or [TEAR_PIECES[0]]
        piece = self.rng.choice(sizes)
        n = -(-len(w.data) // piece)
        shape = self.rng.choice(("prefix", "suffix", "random"))
        if shape == "prefix":
            mask = np.arange(n) < self.rng.randrange(0, n)
        elif shape == "suffix":
            mask = np.arange(n) >= self.rng.randrange(1, n + 1)
        else:
            mask = np.random.default_rng(self.rng.getrandbits(32)).random(n) < 0.5
        return ("tear", piece, shape, mask)

    def _build(self, writes: list[Write], acts: list, words: list, vals: list) -> list:
        undo = []
        for w, act in zip(writes, acts):
            if act == DROP:
                continue
            orig = os.pread(self.fd, len(w.data), w.offset)
            if act == KEEP:
                new = w.data
            else:
                _, piece, _, mask = act
                keep = np.repeat(mask, piece)[:len(w.data)]
                new = np.where(keep, np.frombuffer(w.data, np.uint8), np.frombuffer(orig, np.uint8)).tobytes()
            undo.append((w.offset, orig))
            os.pwrite(self.fd, new, w.offset)
        for (word, _), value in zip(words, vals):
            orig = os.pread(self.fd, 8, word * 8)
            undo.append((word * 8, orig))
            os.pwrite(self.fd, int(value).to_bytes(8, "little"), word * 8)
        return undo

    def _undo(self, undo: list) -> None:
        for offset, orig in reversed(undo):
            os.pwrite(self.fd, orig, offset)

    @staticmethod
    def _describe(writes, acts, words, vals) -> str:
        parts = []
        for w, a in zip(writes, acts):
            a = a if isinstance(a, str) else f"torn/{a[1]}B/{a[2]}({int(a[3].sum())} of {len(a[3])} pieces)"
            parts.append(f"write#{w.id}@{w.offset}+{len(w.data)}:{a}")
        parts += [f"word@{word * 8}={v:#x}" for (word, _), v in zip(words, vals)]
        return ", ".join(parts) or "nothing pending"

    # -- driver
    def run(self, progress: Callable[[CrashSimReport], None] | None = None) -> CrashSimReport:
        started = time.monotonic()
        report = CrashSimReport()
        # which crash points to test
        self._reset()
        points = []
        for n, ev in enumerate(self.rec.events):
            if self._apply(ev):
                points.append(n)
        os.close(self.fd)
        report.crash_points = len(points)
        chosen = set(points)
        if self.max_points is not None and len(points) > self.max_points:
            # always the moment just before each barrier completes (the most writes pending)
            before_barrier = {n - 1 for n, ev in enumerate(self.rec.events) if isinstance(ev, BarrierEnd)}
            must = [p for p in points if p in before_barrier][: self.max_points // 2]
            rest = [p for p in points if p not in must]
            chosen = set(must) | set(self.rng.sample(rest, self.max_points - len(must)))
        self._reset()
        scratch = os.path.join(self.workdir, "continue.image")
        try:
            for n, ev in enumerate(self.rec.events):
                new_state = self._apply(ev)
                if not (new_state and n in chosen and len(report.failures) < self.max_failures):
                    continue
                report.crash_points_tested += 1
                writes = list(self.pending.values())
                words = self._pending_words()
                report.max_pending_writes = max(report.max_pending_writes, len(writes))
                report.max_pending_words = max(report.max_pending_words, len(words))
                images, exhaustive = self._images(writes, words)
                if exhaustive:
                    report.exhaustive_points += 1
                else:
                    report.sampled_points += 1
                for acts, vals in images:
                    undo = self._build(writes, acts, words, vals)
                    meta_before = crc32(os.pread(self.fd, self.rec.watch_bytes, 0))
                    torn = {w.offset for w, a in zip(writes, acts)
                            if not isinstance(a, str) and (a[1] < 512 or len(w.data) > 4096)}
                    fails = check_image(self.image, self.truth, self.rec.expected, torn)
                    if crc32(os.pread(self.fd, self.rec.watch_bytes, 0)) != meta_before:
                        fails.append("reading the region changed its metadata")
                    report.images += 1
                    if any(not isinstance(a, str) for a in acts):
                        report.torn_images += 1
                    if not fails and self.continue_every and report.images % self.continue_every == 0:
                        copy_sparse(self.image, scratch)
                        fails = continue_image(scratch, self.truth, self.rec.expected, torn)
                        report.continued += 1
                    if fails:
                        where = f"crash after event {n} ({type(ev).__name__}): {self._describe(writes, acts, words, vals)}"
                        report.failures.append(f"{where}\n    " + "\n    ".join(fails))
                        if self.keep_failed:
                            shutil.copyfile(self.image, os.path.join(self.workdir, f"failed-{n}-{report.images}.image"))
                    self._undo(undo)
                if progress:
                    progress(report)
        finally:
            os.close(self.fd)
        report.seconds = time.monotonic() - started
        return report
