"""ckptfs as the storage DCP loads from: ``dcp.load(sd, storage_reader=StorageReader(store, model))``.

Every rank: the ranks agree on the newest step that every node's region records (a crash between
two nodes' commits leaves them one step apart for a while: the older is taken, and its parts were
not released), read its metadata from their own region (JSON: ``ckptfs.dist.codec``; checked to
be the same checkpoint on every node), and each reads the pieces its load plan asks for from the
parts (``ckptfs.dist.load``), in whichever given region holds them. DCP's planner reshards.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ckptfs.dist.codec import decode_metadata
from ckptfs.dist.group import coordination, exchange, meet_before_dcp, this_rank, world_size
from ckptfs.dist.load import PartRead, read_parts, wanted_tensors
from ckptfs.dist.names import METADATA_FILE, is_global_version
from ckptfs.dist.parts import item_records, open_part
from ckptfs.dist.single import ONE_PROCESS, one_process_metadata, open_one_process
from ckptfs.errors import CkptfsError, CorruptionError, NotFoundError, no_version_yet
from ckptfs.gcpause import GCHold, paused_gc
from ckptfs.scan import ReadAhead, ReadBuffers


OPEN_THREADS = 8  # the parts of a load opened at once


class StorageReader(_DCPReader):
    """Reads the newest global DCP checkpoint of ``model`` (or ``step``) that every node
    records. ``store``: this rank's node's region; ``peers``: other regions whose parts it may
    need (another node's, reachable from here, as in a test of two nodes on one machine)."""

    def __init__(self, store, model: str, step: int | None = None, *, peers=(), timeout_s: float = 300.0,
                 group=None):
        super().__init__()
        self.group = group
        self.store = store
        self.model = model
        self.step = step
        self.timeout_s = timeout_s
        self.regions = {s.region.superblock.uuid.hex(): s for s in (store, *peers)}
        self.metadata: Metadata | None = None
        self._ahead: _LoadAhead | None = None  # see prepare_local_plan
        self._guess: _Guess | None = None  # see read_metadata
        self._gc_hold = GCHold()  # see checkpoint_id

    def reset(self, checkpoint_id=None) -> None:
        self._drop_ahead()
        self._gc_hold.release()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    @property
    def checkpoint_id(self) -> str:
        """This load's name in DCP's logs: ``ckptfs:MODEL@STEP`` (``@newest`` without a step).
        Where DCP reads it just before its planning gather, the ranks meet first
        (``meet_before_dcp``): a rank that never calls ``dcp.load`` is named after ``timeout_s``.
        From there to the end of read_data the cyclic GC is paused: DCP's metadata and
        planning, much of it between our calls, started a full collection of the rank's heap in
        most loads (see ckptfs.gcpause). A load that fails before read_data resumes it at the
        reader's reset or next load, when the reader goes, or after ``timeout_s``."""
        if meet_before_dcp(self, "_load_state_dict", f"dcp.load of {self.model!r}", load=True):
            self._gc_hold.hold(self.timeout_s)
        return f"ckptfs:{self.model}@{'newest' if self.step is None else self.step}"

    def read_metadata(self, *args, **kwargs) -> Metadata:
        # every rank runs this (DCP's local step of a load): the ranks agree on the step here
        try:
            with paused_gc():  # the metadata's thousands of objects: see ckptfs.gcpause
                return self._read_metadata()
        except BaseException:
            self._gc_hold.release()  # no load follows (none to read yet, another job's region)
            raise

    def _read_metadata(self) -> Metadata:
        # the group first: made collectively, it must not wait for a rank that failed before it
        group = self.group if self.group is not None else coordination(self.timeout_s, self.model, "load")
        steps = {v.step for v in self.store.versions(self.model, missing_ok=True)}
        if self.step is not None:
            steps &= {self.step}
        agreed = set.intersection(*[set(s) for s in exchange(sorted(steps), group,
                                                              f"the agreement on a step of {self.model!r} to load")])
        if not agreed:
            if self.step is not None:
                raise NotFoundError(f"step {self.step} of {self.model!r} is not a version that every node records; "
                                    "`ckptfs ls` lists the steps")
            raise no_version_yet(self.model)
        step = max(agreed)
        metadata, record, failure = self._read_step(step)
        self._compare_nodes(step, record, failure, group)
        self.metadata = metadata
        self._drop_ahead()
        self._guess = _Guess(self, metadata, world_size(group))
        return metadata

    def _read_step(self, step: int) -> tuple[Metadata | None, bytes, CkptfsError | None]:
        """(the DCP Metadata of ``step``, the bytes the nodes compare, None), or (None, b"", the
        CkptfsError that stopped this rank: said to the others, which would wait for it)."""
        try:
            with self.store.open_version(self.model, step) as v:
                if is_global_version(v.manifest):
                    text = dict(v.manifest.files)[METADATA_FILE]
                    return decode_metadata(text), text.encode(), None
                # saved by one process: its metadata made from its index (ckptfs.dist.single)
                return one_process_metadata(v, self.store.region.superblock.uuid.hex()), v.manifest.encode(), None
        except CkptfsError as e:
            return None, b"", e

    def _compare_nodes(self, step: int, record: bytes, failure: CkptfsError | None, group) -> None:
        """Every rank's outcome of ``_read_step``: this rank's failure, another's, or nodes whose
        regions hold different checkpoints as ``step`` (a node whose region holds the model of
        another job at the same step would load a mixture) raise, on every rank."""
        outcomes = exchange((self.store.path, hashlib.sha256(record).hexdigest(),
                             None if failure is None else f"{type(failure).__name__}: {failure}"), group,
                            f"the comparison of step {step} of {self.model!r} across the nodes")
        if failure is not None:
            raise failure
        failed = [(path, why) for path, _, why in outcomes if why is not None]
        if failed:
            raise CkptfsError(f"the load of step {step} of {self.model!r} failed on another rank, reading "
                              f"{failed[0][0]} ({failed[0][1]})")
        kinds: dict[str, list[str]] = {}
        for path, digest, _ in outcomes:
            kinds.setdefault(digest, []).append(path)
        if len(kinds) > 1:
            raise CorruptionError(f"the nodes' regions hold different checkpoints as step {step} of {self.model!r} "
                                  f"({' / '.join(', '.join(sorted(set(p))) for p in kinds.values())}): one of them "
                                  "belongs to another job; load with the regions of this job only")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The plan is known here, before DCP's planning gathers every rank's (which waits for the
        # slowest, and often for a collection of the garbage DCP made): the parts are opened and
        # their first chunks read now, into the load's read buffers; read_data checks them
        # first. Anything that fails here is left to read_data, which reads as if nothing was.
        guess, self._guess = self._guess, None
        self._drop_ahead()
        try:
            with paused_gc():
                self._ahead = _LoadAhead(self, plan, guess=guess)
        except Exception:  # noqa: BLE001 - an optimization: read_data meets the same error and says it
            self._ahead = None
        finally:
            if guess is not None:
                guess.close()
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        try:
            with paused_gc():
                self._read_data(plan, planner)
        finally:
            self._gc_hold.release()
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.items != plan.items:  # DCP's global planning changed the plan
            ahead.close()
            ahead = None
        if ahead is None:
            ahead = _LoadAhead(self, plan, read=False)
        with contextlib.closing(ahead):
            reads = [PartRead(data, items, planner, scan) for data, items, scan in ahead.parts]
            read_parts(reads, ahead.buffers, ahead.reading)
            ahead.reading = None
        for item, raw in ahead.values:  # a one-process version's values, pickled from its index
            planner.load_bytes(item, io.BytesIO(raw))

    def _drop_ahead(self) -> None:
        for ahead in (self._ahead, self._guess):
            if ahead is not None:
                ahead.close()
        self._ahead = self._guess = None

    def _store_of(self, region: str, rank: int):
        store = self.regions.get(region)
        if store is None:
            what = f"the part of rank {rank}" if rank != ONE_PROCESS else "the version (saved by one process)"
            raise NotFoundError(f"{what} of {self.model!r} is in region {region} (another node's), "
                                "which this rank cannot read: pass that region's store in peers=, or load where "
                                "the parts are (a shared tier to drain them to is not built yet)")
        return store


class _LoadAhead:
    """A load plan's parts, pinned (until ``close``), each with its items ((ReadItem, stored
    tensor index)) and its Scan, made from the plan alone; with ``read``, their first chunks
    read from now on (a ReadAhead, ``reading``) into the load's read buffers."""

    def __init__(self, reader: StorageReader, plan: LoadPlan, read: bool = True, guess: "_Guess | None" = None):
        """``guess``: its reads are taken over where the plan makes them (see _Guess)."""
        self.items = plan.items
        self.buffers = ReadBuffers()
        self.reading: ReadAhead | None = None
        self._pins = contextlib.ExitStack()
        try:
            storage = reader.metadata.storage_data
            by_part: dict[tuple, list] = {}
            self.values = []  # (ReadItem, bytes) of a one-process version's values
            for item in plan.items:
                where = storage[item.storage_index]
                if "bytes" in where:
                    self.values.append((item, where["bytes"]))
                    continue
                by_part.setdefault((where["region"], where["rank"], where["counter"]), []).append((item, where["pos"]))
            # the parts opened at once: each is a few cold reads of headers and an index
            pool = ThreadPoolExecutor(min(OPEN_THREADS, len(by_part) or 1), thread_name_prefix="ckptfs-open")
            opening = []
            try:
                for key, items in sorted(by_part.items()):
                    opening.append(pool.submit(_open_part, reader, key, items, guess))
            finally:
                pool.shutdown(wait=True)
                for done in opening:  # every part opened is held (and closed by close), whatever failed
                    if not done.cancelled() and done.exception() is None:
                        self._pins.enter_context(done.result()[0])
            self.parts = [done.result()[1:] for done in opening]  # the first error
            scans = [scan for _, _, scan in self.parts]
            taken = guess.hand_over(scans) if read and guess is not None else None
            if taken is not None:
                self.buffers.close()
                self.reading, self.buffers = taken
            elif read:
                self.reading = ReadAhead(scans, self.buffers)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """The reads ahead end, the buffers go, the parts are unpinned (idempotent)."""
        if self.reading is not None:
            self.reading.cancel()
            self.reading = None
        self.buffers.close()
        self._pins.close()


class _Guess:
    """This rank's own part of the step being loaded, whole: opened, its scan made and its
    first chunks being read (a ReadAhead) at read_metadata, before the plan is known. DCP plans
    the load between read_metadata and prepare_local_plan (70 ms for GPT-2 + AdamW on an H200's
    host, seconds at tens of thousands of tensors) while the disk waited. A restart at the world
    size it saved at reads the rank's own part whole: there the load takes the part, its scan
    and its reads over (``take_part``, ``hand_over``), and does none of it again; anything not
    taken is dropped (``close``). No guess where the world size changed (a resharded load) or
    this rank saved no part. Made on the caller's thread: on a thread of its own its Python
    work contended with DCP's planning for the GIL (a load of 8,000 tensors took 15 % longer on
    2 cores)."""

    def __init__(self, reader: StorageReader, metadata: Metadata, world: int):
        self._key: tuple[str, int, int] | None = None
        self._part = None  # the pinned part, until taken
        self._made: tuple | None = None  # (its item records (None: one-process), its wanted tensors, its Scan)
        self._reading: ReadAhead | None = None
        self._buffers: ReadBuffers | None = None
        parts = {(w["region"], w["rank"], w["counter"]) for w in metadata.storage_data.values() if "bytes" not in w}
        ranks = {rank for _, rank, _ in parts}
        mine = [key for key in parts if key[1] in (this_rank(), ONE_PROCESS) and key[0] in reader.regions]
        if len(mine) == 1 and len(ranks) == world:  # a one-process version: ranks {ONE_PROCESS}, at world 1
            self._key = mine[0]
            self._read(reader)

    def _read(self, reader: StorageReader) -> None:
        try:
            self._part = part = _open(reader, self._key)
            records = part.manifest.tensors
            stored = item_records(part) if self._key[1] != ONE_PROCESS else None
            indexes = set(stored.values()) if stored is not None else range(len(records))
            wanted = {i: None for i in sorted(indexes) if records[i].nbytes}
            self._made = (stored, wanted, part.data.scanner(only=wanted))
            self._buffers = ReadBuffers()
            self._reading = ReadAhead([self._made[2]], self._buffers)
        except Exception:  # noqa: BLE001 - a guess: the load reads as if none was made
            pass

    def take_part(self, key: tuple[str, int, int]):
        """(the pinned part, its item records, its wanted tensors, its Scan) where ``key`` is
        the part guessed (the caller closes it from now on); else None."""
        if key != self._key or self._part is None or self._made is None:
            return None
        part, self._part = self._part, None
        return (part, *self._made)

    def hand_over(self, scans: list) -> tuple[ReadAhead, ReadBuffers] | None:
        """(the reads, their buffers), now ``scans``' (see ReadAhead.rebind), where the guess
        read what ``scans`` read; else None."""
        if self._reading is None or not self._reading.rebind(scans, self._buffers):
            return None
        taken, self._reading, self._buffers = (self._reading, self._buffers), None, None
        return taken

    def close(self) -> None:
        """The reads not handed over end, the buffers go, a part not taken is unpinned (idempotent)."""
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None
        if self._part is not None:
            self._part.close()
            self._part = None


def _open(reader: StorageReader, key: tuple[str, int, int]):
    """The pinned part ``key`` (region, rank, counter), or the one-process version."""
    region, rank, counter = key
    store = reader._store_of(region, rank)
    if rank == ONE_PROCESS:
        return open_one_process(store, reader.model, counter)
    return open_part(store, reader.model, rank, counter)


def _open_part(reader: StorageReader, key: tuple[str, int, int], items: list, guess: _Guess | None = None):
    """(the pinned part, its VersionData, items as (ReadItem, stored tensor index), its Scan)
    of the part ``key`` (region, rank, counter) for ``items`` ((ReadItem, position in the
    part's item list)), taken from ``guess`` where it made them; the part is closed again if
    anything fails."""
    taken = guess.take_part(key) if guess is not None else None
    part, stored, guessed, scan = taken if taken is not None else (_open(reader, key), None, None, None)
    try:
        if key[1] != ONE_PROCESS:  # one-process: an item's position is its stored tensor's index
            stored = stored if stored is not None else item_records(part)
            items = [(item, stored[pos]) for item, pos in items]
        wanted = wanted_tensors(part.manifest.tensors, items)
        return part, part.data, items, scan if wanted == guessed else part.data.scanner(only=wanted)
    except BaseException:
        part.close()
        raise
