"""What one save carries through the writer's phases: its future, its claim and its progress."""
from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from ckptfs.chunks import IO_ALIGN_BYTES
from ckptfs.region.extents import default_ring_slots, least_ring_slots
from ckptfs.region.format import SLOTS_MAX, STEP_LIMIT
from ckptfs.region.claim import Claim
from ckptfs.writer.plan import SavePlan


def check_positive(name: str, value) -> None:
    """ValueError unless ``value`` (the argument ``name``) is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_options(max_inflight: int, persist_threads: int, chunk_bytes: int, staging_budget_bytes: int | None,
                  slots: int | None, keep_every: int | None, slot_bytes: int | None = None,
                  timeout_s: float = 1.0) -> None:
    """ValueError, in the words of the argument, for a Writer's option out of its range or of
    another type (a str of digits failed the first save with a bare TypeError)."""
    check_positive("max_inflight", max_inflight)
    check_positive("persist_threads", persist_threads)
    check_positive("chunk_bytes", chunk_bytes)
    for name, value in (("slots", slots), ("slot_bytes", slot_bytes), ("staging_budget_bytes", staging_budget_bytes)):
        if value is not None:
            check_positive(name, value)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if chunk_bytes % IO_ALIGN_BYTES:
        raise ValueError(f"chunk_bytes must be a multiple of {IO_ALIGN_BYTES}, got {chunk_bytes}")
    least = least_ring_slots(max_inflight)
    if slots is None and default_ring_slots(max_inflight) > SLOTS_MAX:
        raise ValueError(f"max_inflight={max_inflight} needs a ring of {default_ring_slots(max_inflight)} slots, more "
                         f"than a model can have ({SLOTS_MAX}); pass a smaller max_inflight")
    if slots is not None and not least <= slots <= SLOTS_MAX:
        raise ValueError(f"slots={slots} must be between max_inflight+1={least} and {SLOTS_MAX}: "
                         "N checkpoints in flight need N+1 slots so the latest is never overwritten")
    if keep_every is not None:
        check_positive("keep_every", keep_every)
    if staging_budget_bytes is not None and staging_budget_bytes < chunk_bytes:
        raise ValueError(f"staging_budget_bytes={staging_budget_bytes} is smaller than one chunk ({chunk_bytes})")


def is_kept(step, keep: bool | None, keep_every: int | None) -> bool:
    """Check a save's ``step`` (ValueError) and say whether the version is kept: ``keep``, or
    by default a step that is a multiple of ``keep_every`` (the writers' ``keep_every=``)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < STEP_LIMIT:
        raise ValueError(f"step must be an int from 0 to 2**62 - 1, got {step!r}")
    if keep is None:
        return keep_every is not None and step % keep_every == 0
    return bool(keep)


class ReportedFuture(Future):
    """A future that knows whether its failure reached its caller: ``result`` raised it or
    ``exception`` returned it (the writer's ``wait`` and ``close`` raise a failure no one saw)."""

    error_reported = False

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        except BaseException:
            self.error_reported = self.error_reported or self.done()  # not a timeout
            raise

    def exception(self, timeout=None):
        error = super().exception(timeout)
        self.error_reported = self.error_reported or error is not None
        return error


class SaveFuture(ReportedFuture):
    """The future of one save; ``snapshotted`` completes (with the stall in seconds) once the
    tensors have been copied out and may be modified."""

    def __init__(self):
        super().__init__()
        self.snapshotted: ReportedFuture = ReportedFuture()
        # Who ends the save: its start (Writer._start) once it ``take``s it, else the caller's
        # handler of an interrupt, which ``give_up``s it. Without the hand-over, a Ctrl-C just
        # after the save was queued failed the future of a save that went on and committed.
        self._hand_over = threading.Lock()
        self.taken = False
        self._given_up = False

    def take(self) -> bool:
        """Whether the save goes on: its start has it from now on, unless the caller gave it
        up. Not on the caller's (main) thread: ``with lock`` is not safe against Ctrl-C there;
        a start on the caller's thread sets ``taken`` itself."""
        with self._hand_over:
            if not self._given_up:
                self.taken = True
            return self.taken

    def give_up(self, error: BaseException) -> bool:
        """Fail the save with ``error`` (the caller's interrupt) unless its start took it;
        whether it did."""
        with self._hand_over:
            if self.taken:
                return False
            self._given_up = True
        self.fail(error)
        return True

    @property
    def failure_reported(self) -> bool:
        """Whether the save's failure reached its caller (through either future)."""
        return self.error_reported or self.snapshotted.error_reported

    def fail(self, error: BaseException) -> None:
        """Fail both futures, unless failed already: the first error stands (a save given up on
        its caller's thread after a Ctrl-C may be failed there and by a persist thread)."""
        for f in (self.snapshotted, self):
            try:
                f.set_exception(error)
            except InvalidStateError:
                pass


@dataclass(frozen=True)
class SaveResult:
    """What a completed save future returns."""

    model: str
    step: int
    counter: int
    slot: int
    nbytes: int
    published: bool  # False: a newer checkpoint was already latest when this one committed
    stall_s: float
    durable_s: float


@dataclass(eq=False)
class Job:
    """One save between its claim and its commit (or failure)."""

    model: str
    plan: SavePlan
    future: SaveFuture
    started: float  # perf_counter at save()
    background: bool  # async_snapshot: snapshotted beside the caller, who hears of a failure only from its future
    keep: bool = False  # commit the version kept (a milestone the ring never reuses)
    chunks_left: int = 0
    ready: threading.Event = field(default_factory=threading.Event)  # the slot may be written
    parking: bool = True  # chunks written during the snapshot park their CRCs (see persist.py)
    parked: list = field(default_factory=list)  # (chunk, buffer, pool) of each
    piece_crcs: dict = field(default_factory=dict)  # chunk.start -> CRCs of its pieces (chunks.tensor_crcs)
    error: BaseException | None = None
    stall_s: float = 0.0
    # the slot, claimed beside the snapshot (writer/claimer.py): None until then, and for good
    # where the claim failed; ``claimed`` completes with it or with the claim's error
    claim: Claim | None = None
    claimed: Future = field(default_factory=Future)
    mutex: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.chunks_left = len(self.plan.layout.chunks)

    @property
    def step(self) -> int:
        return self.plan.step

    @property
    def crc_in_snapshot(self) -> bool:
        """A background snapshot takes the chunks' CRCs itself (see snapshot.py)."""
        return self.background

    @property
    def chunks(self):
        return self.plan.layout.chunks
