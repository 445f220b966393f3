"""How a model's slots grow and shrink: extents taken from the region's free space and given back.

A model keeps its newest ``ring_slots`` versions (the slots it was created with), its latest, its
kept versions and whatever a reader has open. Its slots live in up to MAX_EXTENTS extents (runs of
equal slots, docs/FORMAT.md). A claim that finds no free slot large enough (``Ring.claim``) asks
for more here:
  * **outgrown**: the save is larger than every slot (a model saved before its optimizer had
    state, a model that grew): a new extent of ``ring_slots`` slots sized for it with headroom
    (fewer if the region has less room). The smaller slots keep their versions readable and go
    back once those versions are older than the newest ``ring_slots``;
  * **busy**: every slot large enough is latest, kept, pinned by a reader or being written: one
    more slot of the model's size, placed right after an extent of that size where the bytes are
    free (the extent grows, so the entry does not run out of extents), else first fit, or, for a
    model that could not grow in place before, the middle of the largest free run (room to grow
    there). Readers never stall training while the region has room.
After a commit ``give_back`` returns the slots that hold nothing the model keeps and that the
ring does not need to keep ``ring_slots`` versions of its size (an extent is split around a slot
kept in its middle, while the entry has extents to spare), once the model has had slots to
spare at GIVE_BACK_AFTER_COMMITS commits in a row (slots spare when a writer opens: after
``ring_slots`` commits): a ring whose kept or pinned versions come and go (a multi-rank job's
parts stay kept until their step is global) would otherwise give back at one commit the slot it
must take again at the next claim.
Every change is written with the table lock held, new slots' headers wiped before the entry that
names them is written (a stale header there must not look like a version), and slots given back
are locked exclusively first (no reader or writer is in them).
"""
from __future__ import annotations

import itertools
import logging

from ckptfs.errors import CkptfsError, RegionFullError
from ckptfs.region.format import MAX_EXTENTS, SLOT_COMMITTED, SLOTS_MAX, Extent, ModelEntry, unpack_latest
from ckptfs.region.locks import slot_lock_offset
from ckptfs.units import align_up, human_bytes

KEPT = 1 << 62  # Ring._slot_ages' value of a slot holding a kept version: never claimed, sorts last

log = logging.getLogger("ckptfs")

GROWTH_HEADROOM = 1.25  # an outgrown model's new slots leave room for it to grow a little more
GIVE_BACK_AFTER_COMMITS = 8  # spare slots go back once they were spare at this many commits in a row
EXTENTS_FOR_GROWTH = 2  # extents an entry keeps free when splitting extents: room to outgrow them again
SPREAD_EXTENTS = MAX_EXTENTS - EXTENTS_FOR_GROWTH  # the most a split, or slots spread over free runs, leave


def least_ring_slots(max_inflight: int) -> int:
    """The fewest slots of a ring with ``max_inflight`` saves in flight: one for each, and one
    that holds the latest, which a save never overwrites."""
    return max_inflight + 1


def default_ring_slots(max_inflight: int) -> int:
    """A ring's slots unless asked (``slots=``): one more than the least, so that the newest
    ``max_inflight + 1`` versions stay readable while one slot is being overwritten."""
    return least_ring_slots(max_inflight) + 1


class Extents:
    """The extent policy of one ring (``Ring.extents``)."""

    def __init__(self, ring):
        self.ring = ring
        self.region = ring.region
        self._spare_commits = 0  # commits in a row (of this process) after which slots were spare
        self._looked = False  # give_back ran in this process (see there)
        self._kept_commits = 0  # commits since the slots this ring counts kept were looked at

    # ------------------------------------------------------------------ taking
    def reshape(self, ring_slots: int | None, slot_bytes: int | None) -> None:
        """Make an existing model keep ``ring_slots`` versions (more slots now, or fewer given
        back as they empty) and have slots of at least ``slot_bytes`` (larger ones now);
        None leaves either as it is."""
        region = self.region
        if ring_slots is not None and ring_slots != self.ring.entry.ring_slots:
            with region.meta_locked():
                # the slots first, then the new count: a region without room for them refuses
                # with the model as it was (the count written first stayed, and the model then
                # took slot after slot as it saved, until the region was full)
                old = self.ring.refresh()
                usable = self.ring.usable_slots(old, old.slot_bytes)
                if ring_slots > usable:
                    self._add_spread(old, old.slot_bytes, ring_slots - usable)
                now = self.ring.refresh()
                region.write_entry(now.with_extents(now.extents, ring_slots=ring_slots), now)
                self.ring.refresh()
            # fewer: the slots the ring no longer needs go back after commits (give_back), with the
            # versions in them; not here, where a job reopened with a smaller slots= lost its
            # older versions, its rollback points, before it saved anything, without a word
        if slot_bytes is not None and slot_bytes > self.ring.entry.slot_bytes:
            self.add(slot_bytes, outgrown=True, headroom=1.0)

    def fit_writer(self, slots: int | None, slot_bytes: int | None, max_inflight: int) -> None:
        """At a writer's opening on an existing model: its ring as asked (``slots``,
        ``slot_bytes``: see ``reshape``), or, resumed with more saves in flight than the ring
        leaves room for, the default ring (max_inflight + 2: it kept its first writer's, and
        fewer saves were in flight and fewer versions kept than asked); where the region has no
        room for that, a warning, and the saves wait for slots."""
        entry = self.ring.entry
        ring_slots = slots
        if ring_slots is None and entry.ring_slots < least_ring_slots(max_inflight):
            ring_slots = default_ring_slots(max_inflight)
        try:
            self.reshape(ring_slots, slot_bytes)
        except RegionFullError as e:
            if slots is not None or slot_bytes is not None:
                raise
            log.warning("ckptfs: %r keeps %d versions, too few for max_inflight=%d, and the region has no room for "
                        "more slots (%s): saves wait for one another", entry.name, entry.ring_slots, max_inflight, e)

    def add(self, need: int, *, outgrown: bool, headroom: float = GROWTH_HEADROOM) -> ModelEntry:
        """Give the model free slots of at least ``need`` bytes (see the module's docstring);
        RegionFullError if the region has no room for even one."""
        region = self.region
        with region.meta_locked():
            entry = self.ring.refresh()
            if outgrown:
                slot_bytes = max(align_up(int(need * headroom), region.superblock.block_bytes), need)
                # the whole ring if there is room, else fewer (the rest follow as room is made)
                counts = sorted({n for n in (entry.ring_slots, 2, 1) if n <= entry.ring_slots}, reverse=True)
            else:
                slot_bytes, counts = max(entry.slot_bytes, need), [1]
            error = None
            for nslots in counts:
                try:
                    new = self._add(entry, slot_bytes, nslots)
                except RegionFullError as e:
                    error = e  # the last, of the fewest slots: what the region lacks at the least
                    continue
                log.info("model %r: %d more slot(s) of %s (%s)", entry.name, nslots, human_bytes(slot_bytes),
                         "its checkpoints outgrew its slots" if outgrown else "every slot was busy")
                self.ring.refresh()
                return new
            raise error

    def _add_spread(self, entry: ModelEntry, slot_bytes: int, nslots: int) -> ModelEntry:
        """``_add`` of ``nslots`` slots, in one extent where a free run holds them, else spread
        over the free runs: all or none (RegionFullError, the entry as it was). A model reopened
        with more ``slots=`` in a region whose free space was in holes was refused although the
        holes held them."""
        try:
            return self._add(entry, slot_bytes, nslots)
        except RegionFullError as e:
            whole = e
        counts = sorted((n for a, b in self.region.free_runs(self.region.entries())
                         if (n := (b - a) // slot_bytes)), reverse=True)
        taken = list(itertools.accumulate(counts))
        pieces = next((i + 1 for i, total in enumerate(taken) if total >= nslots), None)
        if pieces is None or len(entry.extents) + pieces > SPREAD_EXTENTS:
            raise whole
        for count in counts[:pieces]:  # largest first: each fits the run it was counted in, or a larger
            count = min(count, nslots)
            entry = self._add(entry, slot_bytes, count)
            nslots -= count
        return entry

    def _add(self, entry: ModelEntry, slot_bytes: int, nslots: int) -> ModelEntry:
        region = self.region
        nbytes = slot_bytes * nslots
        taken_ids = set(entry.slots())
        extents = list(entry.extents)
        others = region.entries()  # scanned once for every place tried below
        new = None
        for i, x in enumerate(extents):
            ids = range(x.first_slot + x.nslots, x.first_slot + x.nslots + nslots)
            if x.slot_bytes == slot_bytes and ids.stop <= SLOTS_MAX and not taken_ids.intersection(ids):
                if region.find_gap(nbytes, prefer=x.end, entries=others) == x.end:
                    extents[i] = Extent(x.offset, slot_bytes, x.nslots + nslots, x.first_slot)
                    new = Extent(x.end, slot_bytes, nslots, ids.start)
                    break
        if new is None:
            if len(extents) >= MAX_EXTENTS:
                raise RegionFullError(f"model {entry.name!r} has {MAX_EXTENTS} extents, the most an entry holds; "
                                      "unkeep or remove versions of it")
            first = next(i for i in range(SLOTS_MAX) if not taken_ids.intersection(range(i, i + nslots)))
            if first + nslots > SLOTS_MAX:
                raise RegionFullError(f"model {entry.name!r} has {SLOTS_MAX} slots, the most it can have")
            # A model that could not extend its slots in place before (another model's follow
            # them: a model and its EMA keeping milestones in turn) takes its next where they can
            # grow, instead of one more of the entry's MAX_EXTENTS per slot; first fit otherwise
            # (the middle of the largest free run halves it: a larger ring may not fit any more)
            crowded = sum(1 for x in extents if x.slot_bytes == slot_bytes) >= 2
            new = Extent(region.find_gap(nbytes, what=f"more slots of {entry.name!r}", entries=others,
                                         room_to_grow=crowded), slot_bytes, nslots, first)
            extents.append(new)
        region.backend.reserve(new.offset, nbytes)
        grown = entry.with_extents(extents)
        region.wipe_slot_headers(grown, new.slots)
        region.write_entry(grown, entry)
        return grown

    # ------------------------------------------------------------------ giving back
    def give_back(self, *, now: bool = False) -> bool:
        """After a commit: return the slots the model does not need (see the module's docstring):
        smaller slots of an outgrown model at once (no save can take them again), spare slots of
        its size once it has had some at GIVE_BACK_AFTER_COMMITS commits in a row (``now``: at
        once). Cheap when there is nothing to return: the table lock is taken only then. Never
        raises: the commit it follows is complete; slots not given back now go at a later one."""
        entry = self.ring.entry
        try:
            ages = self._ages(entry)
        except (CkptfsError, OSError) as e:
            log.warning("model %r: spare slots not given back this time: %s", entry.name, e)
            return False
        kept = sum(1 for age in ages.values() if age == KEPT)
        # smaller slots that all hold kept versions (step 0, saved before the optimizer had
        # state, kept by keep_every) have nothing to give: no scan of every header for them
        small = [s for x in entry.extents if x.slot_bytes < entry.slot_bytes for s in x.slots]
        outgrown = any(ages[s] != KEPT for s in small)
        if entry.nslots - kept > entry.ring_slots:  # no lock
            if not self._looked:
                # slots spare from before this writer (a job reopened with a smaller slots=, or
                # slots taken beside readers before a restart) go after ring_slots commits, once
                # the ring's versions are this job's: counted from 0 in every process, a job
                # restarted before its 8th save never gave them back
                self._spare_commits = max(0, GIVE_BACK_AFTER_COMMITS - entry.ring_slots)
            self._spare_commits += 1
        else:
            self._spare_commits = 0
        self._looked = True
        if not (now or outgrown or self._spare_commits >= GIVE_BACK_AFTER_COMMITS):
            return False  # the usual case: no scan, no lock
        try:
            with self.region.meta_locked():
                given = self._give_back_locked(self.ring.refresh(), spare=now or
                                               self._spare_commits >= GIVE_BACK_AFTER_COMMITS)
        except (CkptfsError, OSError) as e:
            log.warning("model %r: spare slots not given back this time: %s", entry.name, e)
            return False
        if given:
            self._spare_commits = 0
        return given

    def _ages(self, entry: ModelEntry) -> dict[int, int]:
        """The ring's ages of ``entry``'s slots: cached (no header read) unless another claim's
        wait cleared them, and read again from the headers every GIVE_BACK_AFTER_COMMITS commits
        while it counts a slot kept. An unkeep or a removal by another process (`ckptfs unkeep`,
        a multi-rank job's leader) does not reach the cache: the version unkept stayed listed
        and its slot was neither reused nor given back for as long as this writer stayed open."""
        ages = self.ring._slot_ages(entry)
        if KEPT in ages.values():
            self._kept_commits += 1
            if self._kept_commits >= GIVE_BACK_AFTER_COMMITS:
                self._kept_commits = 0
                self.ring._forget_ages()
                ages = self.ring._slot_ages(entry)
        return ages

    def give_back_emptied(self) -> bool:
        """Give back the empty slots the model does not need (versions removed: ``Store.remove``
        where no writer of the model is open); never a slot holding a version."""
        with self.region.meta_locked():
            return self._give_back_locked(self.ring.refresh(), only_empty=True)

    def _give_back_locked(self, entry: ModelEntry, spare: bool = True, only_empty: bool = False) -> bool:
        """Give back the slots of ``entry`` it does not keep (the table lock is held); those of
        the model's size only where ``spare`` (else only smaller ones); ``only_empty``: none
        that holds a version. Kept: latest, kept
        versions, pinned or claimed slots, the newest ``ring_slots`` versions, and enough slots
        of the model's size for ``ring_slots`` versions. A slot it keeps in the middle of an
        extent splits the extent (a milestone kept in an outgrown model's old slots must not
        hold the slots around it), as far as the entry has extents to spare
        (``_within_extent_limit``)."""
        region = self.region
        headers = {s: region.read_header(entry, s) for s in entry.slots()}
        latest = unpack_latest(region.latest_word(entry))
        committed = sorted((h.counter, s) for s, h in headers.items() if h is not None and h.state == SLOT_COMMITTED)
        kept = {s for s, h in headers.items() if h is not None and h.state == SLOT_COMMITTED and h.kept}
        keep = set(kept) | ({s for _, s in committed} if only_empty else set())
        if latest is not None:
            keep.add(latest[1])
        keep |= {s for _, s in committed[-entry.ring_slots:]}
        size = entry.slot_bytes
        usable = sum(1 for s in entry.slots() if entry.slot_size(s) >= size and s not in kept)
        locks: dict[int, int] = {}  # dropped slot -> its lock byte, held exclusively
        runs: list[tuple[Extent, list[int]]] = []  # per extent, the slots it still holds
        try:
            # smaller slots first (they can never take a save of the model's size), newest extents next
            for x in sorted(entry.extents, key=lambda x: (x.slot_bytes >= size, -x.first_slot)):
                held = []
                for slot in reversed(x.slots):
                    if slot in keep or (x.slot_bytes >= size and (usable <= entry.ring_slots or not spare)):
                        held.append(slot)
                        continue
                    lock = slot_lock_offset(entry.index, slot)
                    if not self.ring._claims.try_exclusive(lock):
                        held.append(slot)  # a reader or a claim is in it
                        continue
                    locks[slot] = lock
                    usable -= x.slot_bytes >= size
                runs.append((x, sorted(held)))
            extents = _within_extent_limit(runs, max(len(entry.extents), SPREAD_EXTENTS))
            for slot in [s for x in extents for s in x.slots if s in locks]:  # held again to stay in the limit
                self.ring._claims.release(locks.pop(slot))
            if not extents or not locks:  # a model keeps at least one extent
                return False
            region.write_entry(entry.with_extents(extents), entry)
            self.ring.refresh()
            return True
        finally:
            for lock in locks.values():
                self.ring._claims.release(lock)


def _within_extent_limit(runs: list[tuple[Extent, list[int]]], limit: int) -> list[Extent]:
    """The extents that hold the slots each extent of ``runs`` still holds (ascending ids): one
    per run of consecutive ids, at most ``limit`` in all. Over the limit, the runs of one extent
    closest to each other are joined again, slots between them included (they stay the model's:
    an entry holds MAX_EXTENTS extents, and an outgrown model needs one more)."""
    pieces: list[list[Extent]] = []
    for x, held in runs:
        mine: list[Extent] = []
        for slot in held:
            if mine and mine[-1].first_slot + mine[-1].nslots == slot:
                last = mine[-1]
                mine[-1] = Extent(last.offset, last.slot_bytes, last.nslots + 1, last.first_slot)
            else:
                mine.append(Extent(x.offset + (slot - x.first_slot) * x.slot_bytes, x.slot_bytes, 1, slot))
        pieces.append(mine)
    while sum(map(len, pieces)) > limit:
        gap, i, j = min((b.first_slot - (a.first_slot + a.nslots), i, j)
                        for i, mine in enumerate(pieces) for j, (a, b) in enumerate(zip(mine, mine[1:])))
        a, b = pieces[i][j], pieces[i][j + 1]
        pieces[i][j:j + 2] = [Extent(a.offset, a.slot_bytes, b.first_slot + b.nslots - a.first_slot, a.first_slot)]
    return [x for mine in pieces for x in mine]
