"""What ``ckptfs status`` (``Store.status``) reports of a region: its geometry and usage, and per
model its versions, kept steps, saves in flight, and the processes that pin its versions (through
the region's lock bytes, or behind a mount) or hold a writer of it."""
from __future__ import annotations

import os

from ckptfs.fs.readers import readers_behind_mounts
from ckptfs.region.backend import free_bytes
from ckptfs.region.holders import lock_holders
from ckptfs.region.locks import model_lock_offset, slot_lock_offset
from ckptfs.writer.progress import read_progress


def region_status(store) -> dict:
    """The report of ``store``'s region (the fields ``ckptfs status --json`` prints)."""
    region = store.region
    models = []
    holders = lock_holders(store.path) if os.path.exists(store.path) else {}
    pins_by_model = []
    for entry in region.entries():
        versions = region.committed(entry)  # one pass over the headers
        latest = region.latest(entry, versions)
        committed = {v.slot: v.header for v in versions}
        latest_slot = latest.slot if latest else -1
        busy = [s for s in entry.slots() if region.is_busy(entry, s)]
        # a reader's pin is a shared (READ) lock; a writer's claim an exclusive one (shared from
        # its header's barrier to its publish, a moment: its pid then shows as a reader's)
        pinned = [{"step": committed[s].step, "slot": s,
                   "holders": [(pid, cmd) for pid, cmd, kind in holders.get(slot_lock_offset(entry.index, s), ())
                               if kind == "READ"]} for s in busy if s in committed]
        pins_by_model.append((entry.name, pinned))
        models.append({
            "name": entry.name,
            "slots": entry.nslots,
            "slot_bytes": entry.slot_bytes,
            "ring_slots": entry.ring_slots,
            "used_bytes": entry.nbytes,
            "versions": len(committed),
            "kept_steps": sorted(h.step for h in committed.values() if h.kept),
            "latest_step": latest.header.step if latest else None,
            # a claimed slot that is neither latest nor committed is a save in flight
            "saves_in_flight": sum(1 for s in busy if s != latest_slot and s not in committed),
            "pinned_or_writing_slots": busy,
            "pinned": [p for p in pinned if p["holders"]],
            # the processes with a writer of the model open (its ring's lock: ring.Ring)
            "writers": sorted({(pid, cmd) for pid, cmd, _ in holders.get(model_lock_offset(entry.index), ())}),
        })
    readers_behind_mounts(store.path, pins_by_model)
    return {"path": store.path, "kind": region.backend.kind, **store.space(models), **_unbacked_bytes(store),
            "models": models, "saves_in_flight": read_progress(region.superblock.uuid)}


def _unbacked_bytes(store) -> dict:
    """Of a sparse region file: {"unallocated_bytes": its bytes the filesystem has not
    allocated yet, "filesystem_free_bytes": what the filesystem under it can still give}
    (a save into unallocated slots fails with ENOSPC once the second is short); {} for a
    device."""
    if store.region.backend.kind != "file":
        return {}
    st = os.stat(store.path)
    return {"unallocated_bytes": max(0, st.st_size - st.st_blocks * 512),
            "filesystem_free_bytes": free_bytes(store.path)}
