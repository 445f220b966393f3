"""How the ranks of a job coordinate a checkpoint: a gloo group of ckptfs's own (its collectives
run from background threads, never behind the job's NCCL traffic), the exchange of every rank's
outcome, the agreement on model and step, and the marks in the job's key-value store that name
the ranks that never came to a round (a collective that times out does not say who), through
which the ranks also meet before a collective that is not ckptfs's own (DCP's planning gather)."""
from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

from ckptfs.errors import CkptfsError

_groups: dict[tuple[float, str, str], object] = {}
_world: list = [None]  # the default process group that _groups and the counts below were made under


def coordination(timeout_s: float, model: str, purpose: str = "save"):
    """The gloo group the checkpoint's ranks coordinate through (None without torch.distributed):
    one of its own per process, ``model`` and ``purpose``, made collectively at the first save or
    load of it on every rank, so that its collectives run from background threads beside the
    training's own (an async save while FSDP all-gathers on the job's group) and never wait
    behind its NCCL traffic. A group's collectives must come in the same order on every rank, so
    two threads that each keep their own order each take a group of their own: a writer's
    snapshots and its commits, and the writers of two models in one process (a model and its
    EMA: one's commit met the other's on another rank, and gloo aborted the process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    with _arrivals_lock:
        _forget_destroyed_world(dist.group.WORLD)
    key = (timeout_s, model, purpose)
    group = _groups.get(key)
    if group is None:
        group = _groups[key] = _new_group(timeout_s, model, purpose)
    return group


def _new_group(timeout_s: float, model: str, purpose: str):
    """``dist.new_group`` (gloo, ``timeout_s``), collective over the world; where it fails (a
    rank that never came: a bare store timeout naming no one), CkptfsError naming the ranks
    that did not come, from marks each rank leaves in the job's key-value store first."""
    import torch.distributed as dist

    kv, rank = _kv_store(), dist.get_rank()
    mark = f"ckptfs/group/{model}/{purpose}/"
    if kv is not None:
        kv.set(mark + str(rank), "1")
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception:
        if kv is None:
            raise
        try:
            absent = [r for r in range(dist.get_world_size()) if not kv.check([mark + str(r)])]
        except Exception:  # noqa: BLE001 - the store gone with its rank: the error in flight stands
            absent = []
        if not absent:
            raise
        load = purpose == "load"
        raise CkptfsError(f"the first {purpose} of {model!r}: rank(s) {', '.join(map(str, absent))} did not come within "
                          f"timeout_s={timeout_s:g} (stopped, or not {'loading' if load else 'saving'} it); nothing was "
                          f"{'read' if load else 'committed'}") from None


def storage_group(storage, purpose: str):
    """The gloo group a DCP storage (``ckptfs.dcp.StorageWriter`` / ``StorageReader``)
    coordinates through: the one it was given (``group=``); none where DCP runs without
    collectives (``no_dist=True``, or a ``process_group=`` of one rank: it saves or loads alone;
    ``meet_before_dcp`` reads which); else ckptfs's own over the whole job."""
    if storage.group is not None:
        return storage.group
    if storage.dcp_solo:
        return None
    return coordination(storage.timeout_s, storage.model, purpose)


def _forget_destroyed_world(world) -> None:
    """Where the default process group is not the one ``_groups`` were made under (the job
    destroyed its group and made another: an in-process restart, a notebook run again), forget
    them and the rounds counted on them: the old groups went with their world (a collective on
    one raises), and every rank of the new one counts its rounds from the start."""
    if _world[0] is world:
        return
    _world[0] = world
    _groups.clear()
    _arrivals.clear()
    _meetings.clear()
    _reported.clear()
    _agreed.clear()


_arrivals: dict[str, int] = {}  # name -> how many rounds of it this process began
_meetings: dict[str, int] = {}  # group name -> how many meetings (``meet``) this process began on it
_reported: set[tuple[str, int, int]] = set()  # (group key, rank, its meeting) failed over (``meet``)
_agreed: dict[tuple, object] = {}  # (group name, model, ...) -> the step last agreed on (``agreed``)
_arrivals_lock = threading.Lock()


def present(kv, keys: list[str]) -> list[bool]:
    """Whether each of ``keys`` is set in the key-value store ``kv``, in as few requests as the
    store's one question allows (``check``: are all of these set?): halves of the keys asked
    until each half is all set or one key, so that m keys missing of W cost about
    2·m·log2(W/m) requests, not W. A meeting that waits for one straggler looks for it now and
    then from every rank: at W = 1024 that is 10-20 requests a look from each, not 1024 (a
    million requests a look at the job's one store)."""
    found = [False] * len(keys)

    def ask(lo: int, hi: int, short: bool) -> bool:
        """Fill found[lo:hi]; whether every key of it is set. ``short``: one of them is known
        to be missing (its parent range lacked one and its sibling lacks none): not asked."""
        if not short and kv.check(keys[lo:hi]):
            found[lo:hi] = [True] * (hi - lo)
            return True
        if hi - lo > 1:
            mid = (lo + hi) // 2
            ask(mid, hi, ask(lo, mid, False))
        return False

    if keys:
        ask(0, len(keys), False)
    return found


class Arrival:
    """This rank's mark in the job's key-value store that it reached a round of ``name`` (each
    rank's n-th round of a name meets the others' n-th; ``shared``: the round the store holds
    open), so that when a collective of the round fails (gloo says only that it timed out) the
    ranks that never came can be named."""

    def __init__(self, group, name: str, shared: bool = False):
        import torch.distributed as dist

        # a group of one rank has no one to wait for or name: no marks (each a store round trip)
        self.kv = _kv_store() if world_size(group) > 1 else None
        if self.kv is None:
            return
        with _arrivals_lock:
            _forget_destroyed_world(dist.group.WORLD)
            if not shared:
                seq = _arrivals[name] = _arrivals.get(name, 0) + 1
        # ``shared``: the round is the one the store holds open for ``name`` (``close`` moves it
        # on once all came), not this process's count of its rounds: a rank that missed one round
        # (a load it skipped) met the others' next rounds never again
        self.opened = f"ckptfs/arrivals/{name}/open" if shared else None
        if shared:
            seq = self.kv.add(self.opened, 0)
        self.key = f"ckptfs/arrivals/{name}/{seq}"
        # a meeting's (``meet``): how many ranks came, and the mark that all did
        self.count, self.came = f"{self.key}/count", f"{self.key}/came"
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.kv.set(f"{self.key}/{self.rank}", "1")

    def missing(self) -> list[int]:
        """The ranks that have not reached this round (after a failed collective)."""
        if self.kv is None:
            return []
        try:
            found = present(self.kv, [f"{self.key}/{r}" for r in self.ranks])
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing to name
            return []
        return [r for r, here in zip(self.ranks, found) if not here]

    def close(self) -> None:
        """Every rank came (said by the one that came last): a shared round's next comers start
        the next round."""
        if self.opened is not None:
            self.kv.add(self.opened, 1)

    def passed(self) -> None:
        """After the round's collective succeeded: the last rank to pass removes the marks."""
        if self.kv is not None and self.kv.add(f"{self.key}/passed", 1) == len(self.ranks):
            for r in self.ranks:
                self.kv.delete_key(f"{self.key}/{r}")
            self.kv.delete_key(f"{self.key}/passed")
            self.kv.delete_key(self.count)
            self.kv.delete_key(self.came)

    def naming(self, what: str, error: BaseException) -> BaseException:
        """``error``, or a CkptfsError ``what`` naming the ranks that never came."""
        missing = self.missing()
        if not missing:
            return error
        return CkptfsError(f"{what}: rank(s) {', '.join(map(str, missing))} never came (stopped, or not saving "
                           "this step); nothing was committed")


MEET_POLL_S = (0.001, 0.05)  # a meeting looks for the others' marks this often: at first, at most
MEET_LOOK_S = 0.1  # after this, which of them are missing and whether they wait elsewhere
MEET_LINGER_S = 0.5  # a rank that finds another at a different save stays visible this long,
MEET_LOOK_MAX_S = 0.4  # so the looks, at doubling intervals, come at most this far apart


def meet(group, agree: dict, timeout_s: float, what: str, *, load: bool = False,
         passed_to: str = "StorageWriter") -> None:
    """Wait until every rank of ``group`` has come to the same save (``load``: load), named by
    ``agree`` ({"model": m, "step": s}), at most ``timeout_s``: marks in the job's key-value
    store, no collective, for a collective that is not ckptfs's own (DCP's planning gather,
    whose wait ends only at its group's timeout, with an error that names no one).

    Raises CkptfsError (check_agreement's) at once when another rank waits at a different save
    or load, and one naming the ranks that have not come when ``timeout_s`` has passed. Either
    way this rank's marks are taken back first, so that a rank that comes later finds it gone
    and fails in turn, rather than going on alone. One meeting at a time per rank and group (as
    DCP's collectives on a group). Without torch.distributed, without a store, or in a group of
    one rank, returns at once. ``passed_to``: where the user gives the model and step (the error
    of ranks that disagree says it).

    Ranks that come together cost a few store requests each: who is missing and where they wait
    is looked up (``present``: about 2·log2(W) requests for one straggler of W ranks) only once
    a meeting has waited MEET_LOOK_S, then at doubling intervals up to MEET_LOOK_MAX_S, shorter
    than MEET_LINGER_S so that a rank that failed over this one is seen."""
    if world_size(group) == 1:
        return
    # the group's ranks in the name: the ranks of two subgroups at the same save counted as one
    # meeting (a rank passed with the other group's, and the last deleted the count under the
    # rest); the rounds are the store's, not each process's count of its own: a rank that skipped a load,
    # or a save tried again after one rank came late, met the others' later rounds never again (a
    # save's name holds its step: one small key per step stays in the store)
    arrival = Arrival(group, f"meet/{_ranks_tag(group)}/{'load' if load else 'save'}/"
                      + "/".join(str(agree[k]) for k in sorted(agree)), shared=True)
    kv = arrival.kv
    if kv is None:
        return
    with _arrivals_lock:
        n = _meetings[group.group_name] = _meetings.get(group.group_name, 0) + 1
    history = (group.group_name, "meet", agree.get("model"))
    mine = {"rank": arrival.rank, "n": n, "load": load, "prev": None if load else agreed(history), **agree}
    waiting = f"ckptfs/meeting/{group.group_name}/"  # + rank: the save that rank waits at now
    kv.set(waiting + str(arrival.rank), json.dumps(mine))
    # the ranks come: a count, and the rank that brings it to W marks "all came", which the others
    # poll, one key (a check of every rank's mark, asked 20-odd times a meeting by each rank, sent
    # the store W keys each time; a poll of the count itself appended a record to a FileStore each
    # time); the marks name the ranks that did not come
    count, came = arrival.count, arrival.came
    if kv.add(count, 1) == len(arrival.ranks):
        arrival.close()
        kv.set(came, "1")
    started = time.monotonic()
    deadline, pause_s, look_s = started + timeout_s, MEET_POLL_S[0], MEET_LOOK_S
    look_at = started + look_s
    counted = True  # this rank's arrival is in the count

    def leave() -> None:
        """Take this rank's arrival back (its mark and its count) before it fails: lingering, so
        that another rank at a different save sees it there, it was counted in that rank's next
        round of this meeting, which then passed without it."""
        nonlocal counted
        _quietly(kv.delete_key, f"{arrival.key}/{arrival.rank}")
        if counted:
            counted = False
            _quietly(kv.add, count, -1)

    try:
        while not kv.check([came]):
            if time.monotonic() >= min(look_at, deadline):  # now and then: who is missing, and where?
                look_s = min(2 * look_s, MEET_LOOK_MAX_S)
                look_at = time.monotonic() + look_s
                missing = arrival.missing()
                _raise_if_elsewhere(kv, waiting, missing, mine, passed_to, leave)
                if time.monotonic() >= deadline:
                    # only a meeting that timed out: a rank that found the others at another save
                    # has told them so, and fails (lingering, it was counted in their next round)
                    counted = False
                    if _every_rank_came(kv, count, came, len(arrival.ranks)):
                        counted = True
                        break
                    _raise_not_come(what, missing, timeout_s, load)
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, MEET_POLL_S[1])
    except BaseException:
        leave()
        raise
    finally:
        _quietly(kv.set, waiting + str(arrival.rank), "")
    arrival.passed()
    if not load:
        agreed(history, agree.get("step"))


def _every_rank_came(kv, count: str, came: str, world: int) -> bool:
    """A rank leaving a meeting takes its arrival back from ``count``. Where that shows that every
    rank had come (the last one passes now, between its count and its ``came``), it puts it back
    and stays, to pass with that one (True): raising, it left the last to go on alone. False: it
    has left (or the store is gone, with its rank: the error in flight says what happened)."""
    try:
        if kv.add(count, -1) != world - 1:
            return False
        kv.add(count, 1)
        kv.set(came, "1")
        return True
    except Exception:  # noqa: BLE001 - see above
        return False


def _raise_not_come(what: str, missing: list[int], timeout_s: float, load: bool) -> None:
    """The error of a meeting past its ``timeout_s``: ``missing``, the ranks without a mark."""
    nothing = "nothing was read" if load else "nothing was committed"
    if missing:
        raise CkptfsError(f"{what}: rank(s) {', '.join(map(str, missing))} did not come within timeout_s="
                          f"{timeout_s:g} (stopped, or not {'loading' if load else 'saving this step'}); {nothing}")
    raise CkptfsError(f"{what}: the ranks did not all come within timeout_s={timeout_s:g} (one was still coming, or "
                      f"stopped as it came); {nothing}")


def meet_before_dcp(storage, dcp_function: str, what: str, *, load: bool = False) -> bool:
    """The ranks meet (``ckptfs.dist.group.meet``: at most ``storage.timeout_s``) if the caller
    of ``storage.checkpoint_id`` is DCP's ``dcp_function`` (``_save_state_dict`` /
    ``_load_state_dict``), which reads it just before its planning gather, outside the handler
    that gathers the ranks' errors: the one place where a storage can stop a ``dcp.save`` or
    ``dcp.load`` before that gather. There a rank that never calls it would keep the others
    waiting until their process group's timeout, with an error that names no one; after the
    meeting they fail after ``timeout_s`` naming it, and ranks at different steps or models fail
    at once. Read anywhere else (DCP's logging, ``async_save``'s calling thread too), nothing
    happens, so that no rank waits for another outside the thread that plans. ``load``: a
    load's meeting (a step of None is the newest). True where the caller is ``dcp_function``
    (a save or load starts), after the meeting."""
    frame = sys._getframe(2)
    if frame.f_code.co_name != dcp_function:
        return False
    import torch.distributed as dist

    # DCP's own view of the ranks (its _DistWrapper): no_dist=True, or a process_group= of one
    # rank (a process that saves or loads alone: it waited timeout_s for the others, then failed
    # naming them), or of some ranks (the others never come); see storage_group
    wrapper = frame.f_locals.get("distW")
    storage.dcp_solo = wrapper is not None and not getattr(wrapper, "use_dist", True)
    if dist.is_available() and dist.is_initialized() and not storage.dcp_solo:
        dcp_group = getattr(wrapper, "group", None)
        if storage.group is None and dcp_group is not None:
            ranks = dist.get_process_group_ranks(dcp_group)
            if len(ranks) == 1:
                storage.dcp_solo = True
                return True
            if len(ranks) < dist.get_world_size():
                # a group of ckptfs's own over those ranks would have to be made by them alone, and
                # torch names such groups by a count of each process's own (ranks holding different
                # numbers of groups never met)
                raise CkptfsError(
                    f"{what}: process_group= holds ranks {', '.join(map(str, ranks[:8]))}"
                    f"{', ...' if len(ranks) > 8 else ''} of the job's {dist.get_world_size()}: pass a gloo group of "
                    f"those ranks to {type(storage).__name__}(group=...) too (made on every rank of the job, in "
                    f"the same order: dist.new_group(ranks, backend='gloo'))")
        step = storage.step if storage.step is not None else "newest"
        meet(storage.group or dcp_group or dist.group.WORLD, {"model": storage.model, "step": step},
             storage.timeout_s, what, load=load)
    return True


def _ranks_tag(group) -> str:
    """A short name of ``group``'s ranks, the same on each of them (a group's own name may not
    be: torch names a group made with use_local_synchronization by a count of this process's)."""
    import hashlib

    import torch.distributed as dist

    ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
    return hashlib.sha1(ranks.encode(), usedforsecurity=False).hexdigest()[:12]


def _quietly(call, *args) -> None:
    """``call(*args)`` on the key-value store, where its failure (the store gone with its rank)
    must not replace the error being raised."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - the error in flight says what happened
        pass


def _raise_if_elsewhere(kv, waiting: str, missing: list[int], mine: dict, passed_to: str = "StorageWriter",
                        leave=lambda: None) -> None:
    """check_agreement's error if one of the ``missing`` ranks waits at another save or load
    now (``waiting`` + rank: where each rank waits, as ``mine``); ``leave`` is called first,
    before the linger."""
    asked = [waiting + str(r) for r in missing]
    keys = [key for key, here in zip(asked, present(kv, asked)) if here]
    elsewhere = [json.loads(v) for v in (kv.multi_get(keys) if keys else []) if v]
    elsewhere = [o for o in elsewhere if (waiting, o["rank"], o["n"]) not in _reported
                 and any(o[k] != mine[k] for k in ("load", "model", "step"))]
    if elsewhere and not mine["load"] and all(o["model"] == mine["model"] and not o["load"] for o in elsewhere):
        newer = newer_saves(mine, elsewhere)
        if newer is None:
            pass  # not steps that order: the disagreement below
        elif newer:
            raise skipped(mine, newer)
        else:
            return  # ahead: the ranks at older steps fail, and come to this step at their next save
    if elsewhere:
        # A rank that finds another at a different meeting fails, and stays visible a while so
        # that the other finds it too and fails alike; each remembers whom it failed over, so
        # that its next meeting does not take that one, still lingering, for a new disagreement.
        _reported.update((waiting, o["rank"], o["n"]) for o in elsewhere)
        leave()
        time.sleep(MEET_LINGER_S)
        everyone = sorted([mine, *elsewhere], key=lambda p: p["rank"])
        if any(o["load"] != mine["load"] for o in elsewhere):
            raise CkptfsError(f"rank(s) {', '.join(str(p['rank']) for p in everyone if p['load'])} load "
                              f"{mine['model']!r} while rank(s) "
                              f"{', '.join(str(p['rank']) for p in everyone if not p['load'])} save it: every "
                              "rank must call the same dcp function; nothing was read or committed")
        load = mine["load"]
        check_agreement(everyone, "StorageReader" if load else passed_to, load)


def _kv_store():
    """The default process group's key-value store (torchrun's TCPStore), or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def world_size(group) -> int:
    """The number of ranks of ``group`` (a gloo group of ``coordination``; None: no
    torch.distributed, one rank)."""
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None else 1


def exchange(mine, group, what: str, arrival: Arrival | None = None) -> list:
    """Every rank's ``mine``, in rank order (just ``[mine]`` without torch.distributed or in a
    group of one rank). ``what`` names the exchange in the error of one that fails (a rank died,
    or never came before the group's timeout: named where ``arrival`` marked this round). (Under
    dcp.save DCP's own gather fails next and reports the dead peer.)"""
    import torch.distributed as dist

    world = world_size(group)
    if world == 1:
        return [mine]  # a job of one rank (two gloo all-gathers and two pickles saved, per save)
    out = [None] * world
    try:
        dist.all_gather_object(out, mine, group=group)
    except RuntimeError as e:
        error = CkptfsError(f"{what} failed, nothing was committed: {' '.join(str(e).split())[:300]}")
        raise (error if arrival is None else arrival.naming(f"{what} failed", error)) from None
    if arrival is not None:
        arrival.passed()
    return out


def newer_saves(mine: dict, others: list[dict]) -> list[dict] | None:
    """Of ``others`` (other ranks' saves of ``mine``'s model at other steps), those at a newer
    step than ``mine``'s, where one rank skipped a save (its state-dict code raised, and its
    loop went on): it is at a newer step than the others, which fail theirs (``skipped``), and
    it waits for them at its own, their next (without this, every later save paired one rank's
    step N with another's N+1, and none committed). A skip is told from ranks that count steps
    differently (an off-by-one counter: they fail at once, every time, ``check_agreement``;
    waiting there stalled both for timeout_s) by ``prev``, the step each rank last agreed on
    with the others (``agreed``): the same on every rank, and not None. None where it is not a
    skip."""
    if mine.get("prev") is None or any(p.get("prev") != mine["prev"] for p in others):
        return None
    if not all(isinstance(p["step"], int) for p in [mine, *others]):
        return None
    return [p for p in others if p["step"] > mine["step"]]


def agreed(key: tuple, step=None):
    """The step this process's ranks last agreed on for ``key`` (a group and model's saves);
    with ``step``, record it."""
    with _arrivals_lock:
        if step is not None:
            _agreed[key] = step
        return _agreed.get(key)


def skipped(mine: dict, newer: list[dict]) -> CkptfsError:
    """The error of a rank whose save another rank skipped (``newer``: ``newer_saves``)."""
    step = max(p["step"] for p in newer)
    ranks = ", ".join(str(p["rank"]) for p in sorted(newer, key=lambda p: p["rank"]))
    return CkptfsError(f"step {mine['step']} of {mine['model']!r} was skipped by rank(s) {ranks}, which save step "
                       f"{step} already (a rank whose state-dict code raised, or that did not save this step); "
                       f"nothing was committed; they wait for this rank's save of step {step}")


def check_agreement(everyone: list[dict], passed_to: str = "StorageWriter", load: bool = False) -> None:
    """CkptfsError (on every rank alike) if the ranks save (``load``: load) different steps or
    models; ``passed_to`` names where the user gives them."""
    for what in ("model", "step"):
        values = {}
        for p in everyone:
            values.setdefault(p[what], []).append(p["rank"])
        if len(values) > 1:
            said = "; ".join(f"{what} {v!r} on rank(s) {', '.join(map(str, ranks))}" for v, ranks in values.items())
            raise CkptfsError(f"the ranks do not {'load' if load else 'save'} the same {what} ({said}): every rank "
                              f"must pass the same {what} to {passed_to}; "
                              f"{'nothing was read' if load else 'nothing was committed'}")


def this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
