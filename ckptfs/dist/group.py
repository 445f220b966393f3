"""How the ranks of a job coordinate a checkpoint: a gloo group of ckptfs's own (its collectives
run from background threads, never behind the job's NCCL traffic), the exchange of every rank's
outcome, the agreement on model and step, and the marks in the job's key-value store that name
the ranks that never came to a round (a collective that times out does not say who)."""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

from ckptfs.errors import CkptfsError

log = logging.getLogger("ckptfs")

_groups: dict[tuple[float, str], object] = {}


def coordination(timeout_s: float, purpose: str = "save"):
    """The gloo group the checkpoint's ranks coordinate through (None without torch.distributed):
    one of its own per process and ``purpose``, made collectively at the first save or load of
    every rank, so that its collectives run from background threads beside the training's own (an
    async save while FSDP all-gathers on the job's group) and never wait behind its NCCL traffic.
    A group's collectives must come in the same order on every rank, so two threads that each
    keep their own order (a writer's snapshots and its commits) each take a group of their own."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = _groups.get((timeout_s, purpose))
    if group is None:
        group = _groups[(timeout_s, purpose)] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return group


_arrivals: dict[str, int] = {}  # name -> how many rounds of it this process began
_arrivals_lock = threading.Lock()


class Arrival:
    """This rank's mark in the job's key-value store that it reached round ``seq`` of ``name``
    (each rank's n-th round of a name meets the others' n-th), so that when a collective of the
    round fails (gloo says only that it timed out) the ranks that never came can be named."""

    def __init__(self, group, name: str):
        import torch.distributed as dist

        self.kv = _kv_store() if group is not None else None
        if self.kv is None:
            return
        with _arrivals_lock:
            seq = _arrivals[name] = _arrivals.get(name, 0) + 1
        self.key = f"ckptfs/arrivals/{name}/{seq}"
        self.ranks = dist.get_process_group_ranks(group)
        self.kv.set(f"{self.key}/{dist.get_rank()}", "1")

    def missing(self) -> list[int]:
        """The ranks that have not reached this round (after a failed collective)."""
        if self.kv is None:
            return []
        try:
            return [r for r in self.ranks if not self.kv.check([f"{self.key}/{r}"])]
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing to name
            return []

    def passed(self) -> None:
        """After the round's collective succeeded: the last rank to pass removes the marks."""
        if self.kv is not None and self.kv.add(f"{self.key}/passed", 1) == len(self.ranks):
            for r in self.ranks:
                self.kv.delete_key(f"{self.key}/{r}")
            self.kv.delete_key(f"{self.key}/passed")

    def warn_after(self, after_s: float, what: str) -> threading.Timer:
        """A timer (started; ``cancel`` it once the round's collective is passed) that, if the
        round is still waited for after ``after_s``, logs a warning naming the ranks that have
        not come to it: for a collective that is not ckptfs's own (DCP's planning gather), whose
        own error, at its group's timeout, will not say who."""
        def warn() -> None:
            missing = self.missing()
            if missing:
                log.warning("ckptfs: %s: rank(s) %s have not come after %.0f s (stopped, or not saving this "
                            "step); the others wait until their process group's timeout", what,
                            ", ".join(map(str, missing)), after_s)

        timer = threading.Timer(after_s, warn)
        timer.daemon = True
        timer.start()
        return timer

    def naming(self, what: str, error: BaseException) -> BaseException:
        """``error``, or a CkptfsError ``what`` naming the ranks that never came."""
        missing = self.missing()
        if not missing:
            return error
        return CkptfsError(f"{what}: rank(s) {', '.join(map(str, missing))} never came (stopped, or not saving "
                           "this step); nothing was committed")


def _kv_store():
    """The default process group's key-value store (torchrun's TCPStore), or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def exchange(mine, group, what: str, arrival: Arrival | None = None) -> list:
    """Every rank's ``mine``, in rank order (just ``[mine]`` without torch.distributed). ``what``
    names the exchange in the error of one that fails (a rank died, or never came before the
    group's timeout: named where ``arrival`` marked this round). (Under dcp.save DCP's own
    gather fails next and reports the dead peer.)"""
    import torch.distributed as dist

    if group is None:
        return [mine]
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, mine, group=group)
    except RuntimeError as e:
        error = CkptfsError(f"{what} failed, nothing was committed: {' '.join(str(e).split())[:300]}")
        raise (error if arrival is None else arrival.naming(f"{what} failed", error)) from None
    if arrival is not None:
        arrival.passed()
    return out


def check_agreement(everyone: list[dict]) -> None:
    """CkptfsError (on every rank alike) if the ranks save different steps or models."""
    for what in ("model", "step"):
        values = {}
        for p in everyone:
            values.setdefault(p[what], []).append(p["rank"])
        if len(values) > 1:
            said = "; ".join(f"{what} {v!r} on rank(s) {', '.join(map(str, ranks))}" for v, ranks in values.items())
            raise CkptfsError(f"the ranks do not save the same {what} ({said}): every rank must pass the same "
                              f"{what} to StorageWriter; nothing was committed")


def this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
