"""What a crash image must hold, and its check (ckptfs.testing.crashsim's step 3): ``Truth``, what
the recorded run had done when the crash came; ``check_image`` opens an image with the real code
and lists what is wrong with it; ``continue_image`` saves into a recovered image; ``same``
compares a loaded object with the saved one (every test that checks a load uses it)."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from ckptfs.region.format import HEADER_COPY_OFFSETS
from ckptfs.store import Store
from ckptfs.testing.recording import Mark

CHUNK_BYTES = 16 << 10  # the chunk size of the recorded run's writers, and of a continuation's
CONTINUE_STEP = 1 << 40  # the steps a continuation saves (above any the run saved)

@dataclass
class Truth:
    """What had been promised at a crash point."""

    started: dict = field(default_factory=dict)      # model -> set of steps whose save began
    saved: dict = field(default_factory=dict)        # model -> {step: counter} of completed saves
    removing_models: set = field(default_factory=set)
    removed_models: set = field(default_factory=set)
    removed_versions: set = field(default_factory=set)  # (model, step)

    def apply(self, mark: Mark) -> None:
        i = mark.info
        if mark.kind == "save_start":
            self.started.setdefault(i["model"], set()).add(i["step"])
        elif mark.kind == "saved":
            self.saved.setdefault(i["model"], {})[i["step"]] = i["counter"]
        elif mark.kind == "remove_model_start":
            self.removing_models.add(i["model"])
        elif mark.kind == "remove_model_done":
            self.removing_models.discard(i["model"])
            self.removed_models.add(i["model"])
        elif mark.kind == "remove_version_done":
            self.removed_versions.add((i["model"], i["step"]))


def same(a, b, path: str = "obj") -> str | None:
    """None if ``a`` and ``b`` are the same nested object, else where and how they first differ:
    types, key order, tensors' dtypes, shapes, devices and bits, floats to the bit (NaN is NaN, -0.0 is
    not 0.0), numpy arrays' dtypes, byte order, shapes, memory order and bytes. The one equality
    of the tests and the reliability runs (tests/conftest.py's assert_same asserts it)."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if a.device != b.device:
            return f"{path}: on {a.device} != on {b.device}"
        if a.numel() and not torch.equal(_bytes_of(a), _bytes_of(b)):
            return f"{path}: tensor bytes differ"
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            d = same(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for n, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{path}[{n}]")
            if d:
                return d
        return None
    if isinstance(a, float):
        bitwise = struct.pack("<d", a) == struct.pack("<d", b)
        return None if bitwise or (a != a and b != b) else f"{path}: {a!r} != {b!r}"
    if type(a).__module__ == "numpy":  # an array or a scalar
        if (a.dtype, a.shape, a.tobytes()) != (b.dtype, b.shape, b.tobytes()) or \
                a.dtype.isnative is not b.dtype.isnative:
            return f"{path}: {a!r} != {b!r}"
        if hasattr(a, "flags") and (a.flags.f_contiguous, a.flags.c_contiguous) != (b.flags.f_contiguous,
                                                                                    b.flags.c_contiguous):
            return f"{path}: memory order differs"
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in order as bytes, whatever its strides."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_image(path: str, truth: Truth, expected: Callable, torn_headers: set = frozenset()) -> list[str]:
    """The invariants of a crash image (see the module doc); returns the violations.

    ``torn_headers``: offsets of writes torn so that a slot header there may be half old, half new
    (pieces below a 512-byte sector), or zeroed while the index page behind it is not (a removal's
    8 KiB write torn at 4 KiB). Such a header is indistinguishable from media damage, and verify
    says so ("the header of slot k (region offset X) is unreadable", or "one copy of the header of
    slot k (region offset X)" where the other copy is intact); that report is expected for those
    offsets, and only for them. The model's next writer repairs a copy (``continue_image``).
    """
    fails: list[str] = []
    try:
        store = Store(path)
    except BaseException as e:  # noqa: BLE001 - any failure to open is a finding
        return [f"the region does not open: {type(e).__name__}: {e}"]
    try:
        models = store.models()
        for m in models:
            if m not in truth.started:
                fails.append(f"model {m!r} is listed but no save of it ever started")
        for m, saved in truth.saved.items():
            if m in truth.removed_models:
                if m in models:
                    fails.append(f"model {m!r} was removed (durably) but is listed")
                continue
            if m not in models:
                if m not in truth.removing_models:
                    fails.append(f"model {m!r} had completed saves {sorted(saved)} but is missing")
                continue
            latest = store.latest(m)
            newest = max(saved, key=lambda s: saved[s])
            if latest is None:
                fails.append(f"model {m!r}: no latest, but step {newest} was reported durable")
            elif latest.counter < saved[newest] or latest.step < newest:
                fails.append(f"model {m!r}: latest is step {latest.step} (counter {latest.counter}) but step "
                             f"{newest} (counter {saved[newest]}) was reported durable")
        for m in models:
            if m not in truth.started:
                continue
            listed = store.versions(m)
            latest = store.latest(m)
            newest_listed = max(listed, key=lambda v: v.counter, default=None)
            if newest_listed is not None and (latest is None or newest_listed.counter != latest.counter):
                fails.append(f"{m}: latest is {latest} but a newer version is listed: {newest_listed}")
            for v in listed:
                if (m, v.step) in truth.removed_versions:
                    fails.append(f"{m} step {v.step} was removed (durably) but is listed")
                if v.step not in truth.started[m]:
                    fails.append(f"{m} lists step {v.step}, which was never saved")
            problems = store.verify(m)
            fails += [f"verify: {p}" for p in problems if not _torn_header_report(p, torn_headers)]
            latest = store.latest(m)
            if latest is not None and latest.step in truth.started[m]:
                try:
                    diff = same(expected(m, latest.step), store.load(m))
                except BaseException as e:  # noqa: BLE001
                    diff = f"load raised {type(e).__name__}: {e}"
                if diff:
                    fails.append(f"{m} latest step {latest.step}: {diff}")
    except BaseException as e:  # noqa: BLE001
        fails.append(f"reading the region raised {type(e).__name__}: {e}")
    finally:
        store.close()
    return fails


def _torn_header_report(problem, torn_headers, *, one_copy: bool = True) -> bool:
    """Whether ``problem`` reports a header torn by one of the writes at ``torn_headers``: both
    copies unreadable, or (``one_copy``: before the model's next writer repaired it) one."""
    m = re.search(r"header of slot \d+ \(region offset (\d+)\) is unreadable", problem.message)
    if m is None and one_copy:
        m = re.search(r"one copy of the header of slot \d+ \(region offset (\d+)\)", problem.message)
    # a header's copies are one write, or (rewritten in place) one write each
    return m is not None and not torn_headers.isdisjoint({int(m.group(1)) + off for off in HEADER_COPY_OFFSETS})


def continue_image(path: str, truth: Truth, expected: Callable, torn_headers: set = frozenset()) -> list[str]:
    """Open the recovered region, save once more to each model and check the new save is latest."""
    fails = []
    try:
        with Store(path) as store:
            for k, m in enumerate(store.models()):
                step = CONTINUE_STEP + k
                with store.writer(m, chunk_bytes=CHUNK_BYTES) as w:
                    r = w.save(expected(m, step | 1), step).result()
                latest = store.latest(m)
                if not r.published or latest is None or latest.step != step:
                    fails.append(f"after recovery, a new save of {m!r} did not become latest "
                                 f"(published={r.published}, latest={latest})")
                    continue
                diff = same(expected(m, step | 1), store.load(m))
                if diff:
                    fails.append(f"after recovery, {m} step {step}: {diff}")
            fails += [f"after recovery: verify: {p}" for p in store.verify()
                      if not _torn_header_report(p, torn_headers, one_copy=False)]
    except BaseException as e:  # noqa: BLE001
        fails.append(f"saving into the recovered region raised {type(e).__name__}: {e}")
    return fails
