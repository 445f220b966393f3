"""bench_save.py's bench and its peers: the rows one state's run records (``Bench``), and the
methods that measure the raw device, a memcpy of the state, torch.save, safetensors, DCP
(save and async_save) and the other write paths, each a generator whose ``next()`` runs one
round and yields {key: sample} (closing it cleans up). ckptfs's own method is bench_save's."""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import time
import warnings
from typing import Any, Callable, Iterator

import torch

import _bench_common as bc
import _raw_io as raw

# key -> (label, kind); kind "baseline" rows feed a target ratio
LABELS: dict[str, tuple[str, str]] = {
    "raw_write": ("raw O_DIRECT write + fdatasync", "baseline"),
    "raw_read": ("raw O_DIRECT read", "baseline"),
    "raw_read_fresh": ("raw O_DIRECT read into fresh memory, one thread", "info"),
    "raw_read_slot": ("raw O_DIRECT read of the version's own blocks, beside Store.load", "info"),
    "raw_overwrite": ("raw O_DIRECT overwrite of the file's blocks", "baseline"),
    "raw_overwrite_b2b": ("raw O_DIRECT overwrite, N+1 states back to back (per state)", "baseline"),
    "memcpy": ("memcpy of the state (copy_, warm)", "baseline"),
    "memcpy_moment": ("memcpy of the state, beside the save (same cache drop)", "baseline"),
    "memcpy_nt": ("same copy by ckptfs's copy_spans (streaming stores)", "info"),
    "d2h_pinned": ("D2H copy into pinned memory (warm)", "baseline"),
    "ckptfs_stall": ("ckptfs save: stall (until save returns)", "ckptfs"),
    "ckptfs_durable": ("ckptfs save: durable (until future result)", "ckptfs"),
    "ckptfs_async_snapshot": ("ckptfs save(async_snapshot=True): until snapshotted", "ckptfs"),
    "ckptfs_load": ("ckptfs Store.load (cold cache, to cpu)", "ckptfs"),
    "ckptfs_load_into": ("ckptfs Store.load(into=) the state's tensors (cold cache)", "ckptfs"),
    "ckptfs_load_dev": ("ckptfs Store.load (cold cache, to device)", "ckptfs"),
    "ckptfs_b2b": ("ckptfs back-to-back saves, N+1 in a row (per save)", "ckptfs"),
    "torch_save": ("torch.save + fsync", "baseline"),
    "safetensors": ("safetensors save_file + fsync", "peer"),
    "dcp_save": ("torch.distributed.checkpoint.save", "peer"),
    "dcp_async": ("torch.distributed.checkpoint.async_save (durable)", "peer"),
    "raw_write_mt": ("raw O_DIRECT write, parallel threads", "info"),
    "raw_read_mt": ("raw O_DIRECT read, parallel threads", "info"),
    "buffered_write": ("buffered write + fsync", "info"),
    "mmap_msync": ("mmap write + msync", "info"),
    "buffered_read": ("buffered read, cold cache", "info"),
}


class Bench:
    """Rows (one per measured key) and notes for one state."""

    def __init__(self, name: str, nbytes: int, args: argparse.Namespace, root: str):
        self.name = name
        self.nbytes = nbytes
        self.args = args
        self.root = root
        self.samples: dict[str, list[dict[str, Any]]] = {}  # key -> per-round {"s": ..., extras}
        self.rounds: list[dict[str, dict[str, Any]]] = []
        self.notes: list[str] = []
        self.dropped_ok = True
        self.first_stalls: list[float] = []  # writers' first saves after prepare, reported apart (issue 21)
        self.cold_first_stall_s: float | None = None  # the same without Writer.prepare
        self.load_into_ok = True

    def drop(self) -> None:
        if self.args.no_drop:
            os.sync()
        elif not bc.drop_caches():
            self.dropped_ok = False

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        print(f"  note: {msg}", flush=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def record(self, rnd: int, key: str, sample: dict[str, Any]) -> None:
        self.samples.setdefault(key, []).append(sample)
        while len(self.rounds) <= rnd:
            self.rounds.append({})
        self.rounds[rnd][key] = sample
        label = LABELS.get(key, (key, ""))[0]
        nb = sample.get("bytes", self.nbytes)
        extra = "".join(f"  {k}={bc.fmt_s(v) if k.endswith('_s') else v}" for k, v in sample.items()
                        if k not in ("s", "bytes"))
        print(f"  [{rnd + 1}] {label:<50} {bc.fmt_s(sample['s']):>9}  {bc.fmt_num(bc.gbps(nb, sample['s'])):>6} GB/s"
              f"{extra}", flush=True)

    def rows(self) -> dict[str, dict[str, Any]]:
        out = {}
        for key, ss in self.samples.items():
            secs = [s["s"] for s in ss]
            nb = ss[0].get("bytes", self.nbytes)
            med = bc.median(secs)
            row = {"label": LABELS.get(key, (key, ""))[0], "kind": LABELS.get(key, ("", "info"))[1],
                   "seconds": secs, "median_s": med, "min_s": min(secs), "bytes": nb, "gbps": bc.gbps(nb, med)}
            for k in ss[0]:
                if k not in ("s", "bytes"):
                    vals = [s[k] for s in ss if k in s]
                    row[k] = bc.median(vals) if all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in vals) else vals
            out[key] = row
        return out


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# methods: generators; each ``next()`` runs one round and yields {key: sample}; closing the
# generator cleans up


def m_raw(b: Bench, buf: raw.AlignedBuffer) -> Iterator[dict]:
    f = b.path("raw.bin")
    ring = b.path("raw-ring.bin")
    k = b2b_saves(b.args)
    try:
        # the baseline of back-to-back saves: as many states as they write, overwritten in a row,
        # each made durable (a burst of one state can land in a cache that N+1 of them overflow)
        raw.odirect_write(ring, k * b.nbytes, buf, threads=1)
        while True:
            bc.remove(f)
            b.drop()
            w = raw.odirect_write(f, b.nbytes, buf, threads=1)
            b.drop()
            r = raw.odirect_read(f, b.nbytes, buf, threads=1)
            b.drop()
            r_fresh = raw.odirect_read_fresh(f, b.nbytes, buf.nbytes)
            b.drop()
            o = raw.odirect_write(f, b.nbytes, buf, threads=1, overwrite=True)
            bc.remove(f)
            b.drop()
            o_k = raw.odirect_write_states(ring, b.nbytes, k, buf)
            yield {"raw_write": {"s": w}, "raw_read": {"s": r}, "raw_read_fresh": {"s": r_fresh}, "raw_overwrite": {"s": o},
                   "raw_overwrite_b2b": {"s": o_k / k, "states": k}}
    finally:
        bc.remove(f)
        bc.remove(ring)


def b2b_saves(args) -> int:
    """How many saves the back-to-back figure makes in a row: the in-flight window plus one."""
    return (args.max_inflight or 2) + 1


def m_extra(b: Bench, buf: raw.AlignedBuffer) -> Iterator[dict]:
    """Other ways to write/read the same bytes (information for choosing the write path)."""
    n, th = b.nbytes, b.args.raw_threads
    f = b.path("extra.bin")
    try:
        while True:
            out = {}
            if th > 1:
                bc.remove(f)
                b.drop()
                out["raw_write_mt"] = {"s": raw.odirect_write(f, n, buf, threads=th), "threads": th}
                b.drop()
                out["raw_read_mt"] = {"s": raw.odirect_read(f, n, buf, threads=th), "threads": th}
            bc.remove(f)
            b.drop()
            out["buffered_write"] = {"s": raw.buffered_write_fsync(f, n, buf)}
            b.drop()
            out["buffered_read"] = {"s": raw.buffered_read(f, n, buf)}
            bc.remove(f)
            b.drop()
            out["mmap_msync"] = {"s": raw.mmap_write_msync(f, n, buf)}
            bc.remove(f)
            yield out
    finally:
        bc.remove(f)


def m_memcpy(b: Bench, state: Any) -> Iterator[dict]:
    dev = b.args.device
    while True:
        out = {}
        dst = bc.clone_like(state)
        bc.copy_state_(dst, state)  # warm: faults in the destination pages
        bc.cuda_sync(dev)
        out["memcpy"] = {"s": bc.median([timed_copy(dst, state, dev) for _ in range(3)])}
        if dev == "cpu":
            out["memcpy_nt"] = _ckptfs_copy(dst, state)
        del dst
        if dev.startswith("cuda"):
            pinned = bc.clone_like(state, device="cpu", pin=True)
            bc.copy_state_(pinned, state, non_blocking=True)
            torch.cuda.synchronize()
            secs = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                bc.copy_state_(pinned, state, non_blocking=True)
                torch.cuda.synchronize()
                secs.append(time.perf_counter() - t0)
            del pinned
            out["d2h_pinned"] = {"s": bc.median(secs)}
        gc.collect()
        yield out


def _ckptfs_copy(dst: Any, state: Any) -> dict:
    """The copy routine ckptfs snapshots with, alone, over the same tensors: how much of the stall
    is the copy itself and how much the rest of ``save`` (and the device writing meanwhile)."""
    from ckptfs.memcopy import copy_spans, default_copy_threads, host_bytes

    threads = default_copy_threads()
    pairs = [(host_bytes(d.reshape(-1).view(torch.uint8)), host_bytes(s.contiguous().reshape(-1).view(torch.uint8)))
             for d, s in zip(bc.iter_tensors(dst), bc.iter_tensors(state)) if s.numel()]
    secs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for d, s in pairs:
            copy_spans(d, [(0, s, 0, len(s))], threads)
        secs.append(time.perf_counter() - t0)
    return {"s": bc.median(secs), "threads": threads}


def m_torch_save(b: Bench, state: Any) -> Iterator[dict]:
    p = b.path("torch.pt")

    def run():
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    yield from _rounds_writing(b, p, "torch_save", run)


def _rounds_writing(b: Bench, path: str, key: str, run) -> Iterator[dict]:
    """One timed ``run`` per round into ``path``, which is removed before and after each."""
    try:
        while True:
            bc.remove(path)
            b.drop()
            s = timed(run)
            bc.remove(path)
            yield {key: {"s": s}}
    finally:
        bc.remove(path)


def m_safetensors(b: Bench, state: Any) -> Iterator[dict]:
    from safetensors.torch import save_file

    flat = {k: v.contiguous() for k, v in bc.flatten_tensors(state).items()}
    p = b.path("st.safetensors")

    def run():
        save_file(flat, p)
        bc.fsync_path(p)

    yield from _rounds_writing(b, p, "safetensors", run)


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def m_dcp(b: Bench, state: Any) -> Iterator[dict]:
    dcp = _dcp()
    extra = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
    p = b.path("dcp")

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(p, sync_files=True), **extra)
        bc.fsync_tree(p)  # directory entries too (FileSystemWriter fsyncs the files only)

    yield from _rounds_writing(b, p, "dcp_save", run)


def m_dcp_async(b: Bench, state: Any) -> Iterator[dict]:
    dcp = _dcp()
    if not hasattr(dcp, "async_save"):
        raise RuntimeError("torch.distributed.checkpoint.async_save is not in this torch")
    extra = {"no_dist": True} if "no_dist" in inspect.signature(dcp.async_save).parameters else {}
    p = b.path("dcp_async")
    try:
        while True:
            bc.remove(p)
            b.drop()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(p, sync_files=True), **extra)
                t1 = time.perf_counter()
                # torch >= 2.8 may return an AsyncSaveResponse (staging + upload futures)
                (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
                bc.fsync_tree(p)
                t2 = time.perf_counter()
            bc.remove(p)
            yield {"dcp_async": {"s": t2 - t0, "stall_s": t1 - t0}}
    finally:
        bc.remove(p)


def timed_copy(dst: Any, state: Any, device: str) -> float:
    """Seconds of one ``copy_`` of every tensor of ``state`` into ``dst``, device work included."""
    bc.cuda_sync(device)
    t0 = time.perf_counter()
    bc.copy_state_(dst, state)
    bc.cuda_sync(device)
    return time.perf_counter() - t0
