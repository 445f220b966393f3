"""Anomaly tests of the save path, as SQLite's test VFS does them: run the same save once per I/O
operation k, failing the k-th with an errno, and check the contract after each run.

``FaultyBackend`` is the real :class:`~ckptfs.region.backend.FileBackend` whose system calls of
the save path (pwrite, fdatasync, msync, fallocate, and the pread of a slot header) go through
a counter: the ``fail_at``-th call raises ``OSError(errno)`` instead of running (as the kernel
would answer), every other call runs. ``FaultyDevdaxBackend`` does the same for the devdax
backend, whose save path is writes and flushes through the mapping (libpmem), not system calls:
there the ``fail_at``-th mapped step meets a page that cannot be read or written, as a poisoned
pmem line would be (the bus guard's own record of a SIGBUS, made on purpose:
``_native.poison_page``). ``sweep`` drives one save per k until a run meets no fault, and
reports every run.

The contract checked after each faulty save (``check_after_fault``):
  * the save raises a ckptfs error that names the operation (RegionIOError), from ``save`` or its
    future; never another exception, a hang or a dead process;
  * the previous latest still loads exactly and everything listed verifies: nothing
    half-written is visible;
  * claims, pins and permits were given back: the next save, on a healthy backend, succeeds and
    becomes latest.
``failing_staging`` makes the staging pool's allocation fail instead (StagingMemoryError), and
``campaign`` runs every sweep (what tools/reliability.py reports).
"""
from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import threading
from dataclasses import dataclass, field

import torch

from ckptfs.errors import CkptfsError, RegionFullError, RegionIOError, StagingMemoryError
from ckptfs import _native
from ckptfs.region.backend import DevdaxBackend, FileBackend
from ckptfs.region.region import Region
from ckptfs.store import Store
from ckptfs.testing.crashcheck import same
from ckptfs.writer import staging
from ckptfs.writer.writer import Writer

OPERATIONS = ("pwrite", "fdatasync", "msync", "fallocate", "pread")
DEVDAX_OPERATIONS = ("pmem write", "pmem persist", "mapped read")


class _Counted:
    """The call counter of a fault-injecting backend: ``calls`` lists every counted call,
    ``failed`` names the one made to fail (the ``fail_at``-th, 1-based; 0: none)."""

    def _start_counting(self, fail_at: int, errno_code: int) -> None:
        self.fail_at = fail_at
        self.errno_code = errno_code
        self.calls: list[str] = []
        self.failed: str | None = None
        self._lock = threading.Lock()

    def _is_the_one(self, operation: str) -> bool:
        with self._lock:
            self.calls.append(operation)
            if len(self.calls) != self.fail_at:
                return False
            self.failed = operation
            return True


class FaultyBackend(_Counted, FileBackend):
    """A FileBackend whose ``fail_at``-th write-path system call (counted over OPERATIONS)
    fails with ``OSError(errno_code)``."""

    def __init__(self, path: str, fail_at: int = 0, errno_code: int = errno_mod.EIO):
        FileBackend.__init__(self, path, writable=True)
        self._start_counting(fail_at, errno_code)

    def _count(self, operation: str) -> None:
        if self._is_the_one(operation):
            raise OSError(self.errno_code, os.strerror(self.errno_code))

    def _pwrite(self, fd, data, offset):
        self._count("pwrite")
        return os.pwrite(fd, data, offset)

    def _fdatasync(self, fd):
        self._count("fdatasync")
        os.fdatasync(fd)

    def _msync(self, mapping, offset, length):
        self._count("msync")
        FileBackend._msync(mapping, offset, length)

    def _fallocate(self, fd, offset, length):
        self._count("fallocate")
        os.posix_fallocate(fd, offset, length)

    def _pread(self, fd, view, offset, path):
        self._count("pread")
        FileBackend._pread(fd, view, offset, path)


class FaultyDevdaxBackend(_Counted, DevdaxBackend):
    """A DevdaxBackend (over a regular file, which stands in for the device) whose
    ``fail_at``-th mapped step (counted over DEVDAX_OPERATIONS) meets a page that cannot be read
    or written: a bus error, so the errno is always EIO."""

    def __init__(self, path: str, fail_at: int = 0, errno_code: int = errno_mod.EIO):
        DevdaxBackend.__init__(self, path, writable=True)
        self._start_counting(fail_at, errno_mod.EIO)

    def _poison_if_the_one(self, operation: str, offset: int) -> None:
        if self._is_the_one(operation):
            _native.poison_page(self._guard, offset)

    def write(self, offset: int, buf) -> None:
        self._poison_if_the_one("pmem write", offset)
        DevdaxBackend.write(self, offset, buf)

    def persist_mapped(self, offset: int, length: int) -> None:
        self._poison_if_the_one("pmem persist", offset)
        DevdaxBackend.persist_mapped(self, offset, length)

    def read_bytes(self, offset: int, length: int) -> bytes:
        self._poison_if_the_one("mapped read", offset)
        return DevdaxBackend.read_bytes(self, offset, length)


@dataclass
class Run:
    fail_at: int
    errno_code: int
    operation: str | None  # the call that failed (None: the save met no fault)
    error: str | None  # what the save raised
    problems: list[str] = field(default_factory=list)


def state(step: int) -> dict:
    """A small state of a few tensors and plain values, different at every step."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "optim": {"step": torch.tensor(float(step)), "lr": 0.1}, "step": step}


def big_state(step: int) -> dict:
    """``state(step)`` with its weights 16 times larger: a save that outgrows the first one's slots."""
    obj = state(step)
    obj["model"]["w"] = torch.randn(256, 256, generator=torch.Generator().manual_seed(step))
    return obj


def one_run(path: str, fail_at: int, errno_code: int, step: int, model: str, devdax: bool = False) -> Run:
    """Save ``state(step)`` with the ``fail_at``-th call failing, then check the contract with a
    healthy region. ``model``: "m" (created before), "n" (created by this save), or "g" (saved
    small just before; this save outgrows its slots and takes larger ones). ``devdax``: through
    the devdax backend (FaultyDevdaxBackend), else the file backend (FaultyBackend)."""
    if model == "g":
        with Store(path) as store:
            if "g" in store.models():
                store.remove_model("g")
            with store.writer("g", max_inflight=2, slots=4, chunk_bytes=8192) as w:
                w.save(state(step - 1), step=step - 1).result()
    backend = (FaultyDevdaxBackend if devdax else FaultyBackend)(path, fail_at, errno_code)
    region = Region(path, backend=backend)
    error = None
    calls_at_commit: list[int] = []  # the backend's call count when the save's commit was complete
    region.commits.subscribe(lambda c: calls_at_commit.append(len(backend.calls)))
    try:
        with Writer(region, model, max_inflight=2, slots=4, chunk_bytes=8192, timeout_s=10) as w:
            try:
                w.save(big_state(step) if model == "g" else state(step), step=step).result(timeout=60)
            except CkptfsError as e:
                error = e
    except CkptfsError as e:  # raised again by close() (it waits for the save): the same error
        error = error or e
    except Exception as e:  # noqa: BLE001 - anything else breaks the contract
        error = e
    finally:
        region.close()
    run = Run(fail_at, errno_code, backend.failed, None if error is None else f"{type(error).__name__}: {error}")
    if backend.failed is not None:
        if error is None and calls_at_commit and fail_at >= calls_at_commit[0]:
            # the last call before the commit's notice: the latest pointer's persist, after the
            # version's header was durable (Ring.publish: the save stands); after it, giving
            # back spare slots: the save is complete, they go back later
            pass
        elif backend.failed == "fallocate" and errno_code == errno_mod.ENOSPC and isinstance(error, RegionFullError):
            pass  # a ring that does not fit: the region-full error says what was needed and what is free
        elif backend.failed == "fallocate" and errno_code == errno_mod.ENOSPC and error is None and model == "g":
            pass  # no room for ring_slots larger slots: the save took fewer (and the ring grows later)
        elif not isinstance(error, RegionIOError):
            run.problems.append(f"{backend.failed} failed but the save raised {run.error!r}, not RegionIOError")
        elif error.operation not in backend.failed and backend.failed not in error.operation:
            run.problems.append(f"{backend.failed} failed but the error names {error.operation!r}")
    elif error is not None:
        run.problems.append(f"no fault injected, yet the save failed: {run.error}")
    run.problems += check_after_fault(path, step, model, saved=error is None)
    return run


def _expected(model: str, step: int) -> dict:
    return big_state(step) if model == "g" and step % 10 == 0 else state(step)


def check_after_fault(path: str, step: int, model: str, saved: bool) -> list[str]:
    """The contract on a healthy region after a faulty save of ``model`` at ``step``."""
    problems = []
    with Store(path) as store:
        try:
            latest = store.latest("m")
            if latest is None or same(store.load("m", latest.step), state(latest.step)) is not None:
                problems.append(f"the previous latest of m (step {latest and latest.step}) does not load exactly")
            # One copy of two left behind by the failed step (an entry or header copy that a
            # bad page kept from being written or set back) is reported and used from the
            # other; the next save repairs it (checked below). Anything else is a finding.
            problems += [f"verify: {p}" for p in store.verify() if not p.repairable]
            if model in store.models() and saved and store.latest(model).step != step:
                problems.append(f"the save completed but latest of {model} is not step {step}")
            if model == "g":
                latest = store.latest("g")
                if latest is None or same(store.load("g"), _expected("g", latest.step)) is not None:
                    problems.append(f"the latest of g (step {latest and latest.step}) does not load exactly")
            # claims, pins and permits given back: the next save works and becomes latest
            with store.writer(model, max_inflight=2, slots=4, chunk_bytes=8192, timeout_s=10) as w:
                w.save(state(step + 1), step=step + 1).result(timeout=60)
            if store.latest(model).step != step + 1 or same(store.load(model), state(step + 1)) is not None:
                problems.append(f"the save after the fault did not become latest of {model}")
            problems += [f"verify after the next save: {p}" for p in store.verify() if p.model == model]
        except Exception as e:  # noqa: BLE001 - any failure here is a finding
            problems.append(f"after the fault: {type(e).__name__}: {e}")
    return problems


@contextlib.contextmanager
def failing_staging(fail_at: int):
    """Staging buffers of the writers in this process fail to allocate from the ``fail_at``-th
    one made (as an mmap refused for lack of memory would)."""
    made = [0]
    original = staging.StagingBuffer.__init__

    def init(self, *args, **kwargs):
        made[0] += 1
        if made[0] >= fail_at:
            raise OSError(errno_mod.ENOMEM, os.strerror(errno_mod.ENOMEM))
        original(self, *args, **kwargs)

    staging.StagingBuffer.__init__ = init
    try:
        yield
    finally:
        staging.StagingBuffer.__init__ = original


def staging_run(path: str, fail_at: int, step: int) -> Run:
    """A save of ``state(step)`` whose ``fail_at``-th staging buffer cannot be allocated."""
    error = None
    try:
        with failing_staging(fail_at), Store(path) as store:
            with store.writer("m", max_inflight=2, slots=4, chunk_bytes=8192, timeout_s=10) as w:
                w.save(state(step), step=step).result(timeout=60)
    except Exception as e:  # noqa: BLE001
        error = e
    run = Run(fail_at, errno_mod.ENOMEM, "staging allocation", None if error is None else f"{type(error).__name__}: {error}")
    if not isinstance(error, StagingMemoryError):
        run.problems.append(f"a staging buffer could not be allocated but the save raised {run.error!r}")
    run.problems += check_after_fault(path, step, "m", saved=False)
    return run


@dataclass
class Campaign:
    runs: list[Run] = field(default_factory=list)

    @property
    def faults(self) -> int:
        return sum(r.operation is not None for r in self.runs)

    @property
    def failures(self) -> list[str]:
        return [f"{os.strerror(r.errno_code)} at call {r.fail_at} ({r.operation}): {p}"
                for r in self.runs for p in r.problems]

    def by_operation(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.runs:
            if r.operation is not None:
                out[r.operation] = out.get(r.operation, 0) + 1
        return out


def campaign(workdir: str, errnos=(errno_mod.EIO, errno_mod.ENOSPC, errno_mod.EROFS)) -> Campaign:
    """Every sweep: each errno, on a model that has versions, on a new one and on one whose save
    outgrows its slots, then the staging allocation failing at the first and the second buffer."""
    path = os.path.join(workdir, "anomaly.region")
    with Store.create(path, size_bytes=64 << 20, force=True) as store:
        with store.writer("m", max_inflight=2, slots=4, chunk_bytes=8192) as w:
            w.save(state(1), step=1).result()
    report = Campaign()
    for code in errnos:
        for model in ("m", "n", "g"):
            report.runs += sweep(path, code, model)
    if _native.pmem_available():
        for model in ("m", "n", "g"):
            report.runs += sweep(path, errno_mod.EIO, model, devdax=True)
    for k, step in ((1, 9000), (2, 9100)):
        report.runs.append(staging_run(path, k, step))
    return report


def sweep(path: str, errno_code: int, model: str = "m", max_runs: int = 200, devdax: bool = False) -> list[Run]:
    """One faulty save per k = 1, 2, ... until a save meets no fault (all its calls were tried);
    ``devdax``: through the devdax backend, each mapped step meeting a bad page in turn."""
    runs = []
    step = {"m": 1000, "n": 5000, "g": 7000}[model]
    for k in range(1, max_runs + 1):
        step += 10
        run = one_run(path, k, errno_code, step, model, devdax)
        runs.append(run)
        if model == "n":
            with Store(path) as store:
                if "n" in store.models():
                    store.remove_model("n")
        if run.operation is None:
            break
    return runs
