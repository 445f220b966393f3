#!/usr/bin/env python3
"""Training emulator: checkpoint overhead of ckptfs against the PCcheck §3.4 model.

One iteration = ``time.sleep(t)`` (the GPU's forward/backward) + an in-place update of every
tensor of the state (``p.add_(0.001)``, the optimizer step). Every f iterations the state is
saved with a writer holding at most N checkpoints in flight (``max_inflight=N``). For each
(N, f) it prints the throughput overhead against the same loop without checkpoints, the
measured per-checkpoint persist time T_w, and what the PCcheck runtime model predicts:

    T_w > N·f·t  (training stalls):   overhead ≈ T_w / (N·f·t) − 1
    otherwise                          overhead ≈ s / (f·t)   (the snapshot stall s only)

(t = measured iteration time without checkpoints, s = stall of one isolated save; the emulator
prints max of the two terms), and f* = ceil(T_w / (N*·q·t)) with N* = argmin_N T_w(N)/N (eq. 3).

Modes (--mode): ``sync`` calls save() between the update and the next compute, so the snapshot
stall is on the critical path; ``overlap`` calls save(..., async_snapshot=True), whose copy runs during the next
iteration's compute phase and makes the update wait for it (CheckFreq/PCcheck style: the weights
do not change during forward/backward), so only max(0, s − t_compute) is exposed.

    python tools/train_emulator.py                       # 256 MiB, t=0.05 s, f∈{1,2,5,10}, N∈{1,2,3}
    python tools/train_emulator.py --quick               # ~30 s smoke run
    python tools/train_emulator.py --mode both --json out/emu.json
See tools/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))

import torch  # noqa: E402

import _bench_common as bc  # noqa: E402
from _raw_checkpointer import RawCheckpointer  # noqa: E402


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


class Emulator:
    def __init__(self, a: argparse.Namespace, root: str):
        self.a = a
        self.root = root
        self.state = bc.make_flat_state(int(a.state_mib * bc.MiB), n_tensors=a.tensors, device=a.device)
        self.tensors = list(self.state.values())
        self.nbytes = bc.state_nbytes(self.state)
        self.region_seq = 0

    # ----------------------------------------------------------------- the loop
    def _update(self) -> None:
        for p in self.tensors:
            p.add_(0.001)
        bc.cuda_sync(self.a.device)

    def baseline(self, iters: int) -> float:
        t0 = time.perf_counter()
        upd = slept = 0.0
        for _ in range(iters):
            s = time.perf_counter()
            time.sleep(self.a.t)
            u = time.perf_counter()
            slept += u - s
            self._update()
            upd += time.perf_counter() - u
        self.last_update_s = upd / iters
        self.last_sleep_s = slept / iters
        return time.perf_counter() - t0

    # ----------------------------------------------------------------- ckptfs plumbing
    def _new_path(self, name: str) -> str:
        """A path for one run's region or file, never used before in this run of the tool."""
        self.region_seq += 1
        return os.path.join(self.root, f"{name}-{self.region_seq}")

    def _open_store(self, n: int):
        import ckptfs

        path = self._new_path("region")
        size = int(self.nbytes * (n + 3) * 1.15) + 256 * bc.MiB
        size = (size + bc.MiB - 1) // bc.MiB * bc.MiB
        return ckptfs.Store.create(path, size_bytes=size), path

    def _writer_kw(self, n: int) -> dict:
        a = self.a
        return bc.writer_kwargs(n, a.persist_threads, a.chunk_mib * bc.MiB if a.chunk_mib else None,
                                a.staging_mib * bc.MiB if a.staging_mib else None)

    @contextlib.contextmanager
    def _checkpointer(self, system: str, n: int):
        """(writer, verify) for one run: ckptfs, or the raw floor (tools/_raw_checkpointer.py).
        ``verify()`` says whether the last save holds the state as it is now."""
        if system == "ckptfs":
            store, path = self._open_store(n)
            try:
                with store.writer("emu", **self._writer_kw(n)) as w:
                    yield w, lambda: bc.states_equal(store.load("emu"), self.state)
            finally:
                store.close()
                bc.remove(path)
            return
        path = self._new_path("raw")
        w = RawCheckpointer(self.tensors, n, path, chunk_bytes=(self.a.chunk_mib or 64) * bc.MiB,
                            write_threads=self.a.persist_threads or 2)
        try:
            yield w, lambda: w.read_back(w.saves - 1) == b"".join(
                t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in self.tensors)
        finally:
            w.close()
            bc.remove(path)

    def calibrate(self) -> dict[str, float]:
        """Isolated saves (N=1, nothing else running): snapshot stall s and persist time T_w0."""
        store, path = self._open_store(1)
        stalls, durs = [], []
        try:
            with store.writer("calib", **self._writer_kw(1)) as w:
                w.save(self.state, step=0).result()  # creates the ring
                for i in range(self.a.calib):
                    time.sleep(0.05)
                    t0 = time.perf_counter()
                    fut = w.save(self.state, step=i + 1)
                    t1 = time.perf_counter()
                    fut.result()
                    t2 = time.perf_counter()
                    stalls.append(t1 - t0)
                    durs.append(t2 - t0)
        finally:
            store.close()
            bc.remove(path)
        return {"stall_s": bc.median(stalls), "tw0_s": bc.median(durs), "stalls": stalls, "durables": durs}

    def run(self, n: int, f: int, iters: int, mode: str, system: str = "ckptfs") -> dict[str, Any]:
        a = self.a
        calls: list[float] = []
        rets: list[float] = []
        done: dict[int, float] = {}
        futs = []
        exposed: list[float] = []  # stall seen by the training loop per checkpoint
        errors: list[str] = []
        lock = threading.Lock()

        def on_done(k):
            def cb(fut):
                with lock:
                    done[k] = time.perf_counter()
                if fut.exception() is not None:
                    errors.append(f"{type(fut.exception()).__name__}: {fut.exception()}")
            return cb

        verified = None
        with self._checkpointer(system, n) as (w, verify):
            # warm-up: the first save creates the model ring; then fill every slot of the
            # ring once (first writes into a sparse region allocate blocks) and fault in the
            # staging pool, so that the loop measures the steady state
            for k in range(self.a.warmup if self.a.warmup >= 0 else n + 2):
                w.save(self.state, step=k)
            w.wait()
            first_step = max(self.a.warmup if self.a.warmup >= 0 else n + 2, 1)

            def do_save(step: int, async_snapshot: bool) -> None:
                k = len(calls)
                calls.append(time.perf_counter())
                rets.append(float("nan"))
                fut = w.save(self.state, step=step, async_snapshot=async_snapshot)

                def snapshotted(_, k=k):
                    rets[k] = time.perf_counter()
                fut.snapshotted.add_done_callback(snapshotted)
                futs.append(fut)
                fut.add_done_callback(on_done(k))

            overlap = mode == "overlap"
            pending = False
            upd = slept = called = 0.0
            t0 = time.perf_counter()
            for i in range(iters):
                s = time.perf_counter()
                time.sleep(a.t)  # compute: in overlap mode the last snapshot runs meanwhile
                slept += time.perf_counter() - s
                if pending:
                    w0 = time.perf_counter()
                    w.wait_snapshot()  # the optimizer step must not run before the snapshot
                    exposed.append(time.perf_counter() - w0)
                    pending = False
                u = time.perf_counter()
                self._update()
                upd += time.perf_counter() - u
                if (i + 1) % f == 0:
                    c = time.perf_counter()
                    do_save(first_step + i + 1, async_snapshot=overlap)
                    called += time.perf_counter() - c
                    if overlap:
                        pending = True
                    else:
                        exposed.append(time.perf_counter() - c)
            loop_s = time.perf_counter() - t0
            t_drain = time.perf_counter()
            w.wait()
            drain_s = time.perf_counter() - t_drain
            if a.verify and iters % f == 0:
                verified = verify()
        # T_w of checkpoint k: from when it could start (its call, or the completion of the
        # checkpoint N places earlier, whose in-flight permit it waits for) to durable.
        tws = []
        for k in range(len(calls)):
            if k not in done:
                continue
            start = calls[k]
            if k >= n and (k - n) in done:
                start = max(start, done[k - n])
            tws.append(done[k] - start)
        stalls = [r - c for c, r in zip(calls, rets)]
        # snapshot time: save() minus the wait for an in-flight permit
        snaps = []
        for k in range(len(calls)):
            start = calls[k]
            if k >= n and (k - n) in done:
                start = max(start, done[k - n])
            snaps.append(max(0.0, rets[k] - start))
        return {"system": system, "N": n, "f": f, "mode": mode, "iters": iters, "loop_s": loop_s, "drain_s": drain_s,
                "checkpoints": len(calls), "tw_s": sum(tws) / len(tws) if tws else float("nan"), "tw_med_s": bc.median(tws),
                "tw_max_s": max(tws) if tws else None, "tws": tws, "stall_s": bc.median(stalls),
                "snap_s": sum(snaps) / len(snaps) if snaps else float("nan"), "update_s": upd / iters,
                "sleep_s": slept / iters, "call_s": called / len(calls) if calls else 0.0,
                "exposed_s": sum(exposed) / len(exposed) if exposed else 0.0,
                "exposed_total_s": sum(exposed), "errors": errors[:3], "verified": verified}


def predict(tw: float, s: float, n: int, f: int, t: float, t_compute: float, mode: str) -> tuple[float, str]:
    """PCcheck §3.4 runtime model (steady state, A large): overhead fraction and regime."""
    stall_term = (s if mode == "sync" else max(0.0, s - t_compute)) / (f * t)
    if tw > n * f * t:
        return max(tw / (n * f * t) - 1.0, stall_term), "stalls"
    return stall_term, "hidden"


def combine_rounds(runs: list[dict]) -> list[dict]:
    """One row per (N, f) from its runs: median overhead and noise (a disk hiccup in one run
    does not decide), T_w and snapshot averaged over every checkpoint, the worst T_w max."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["N"], r["f"]), []).append(r)
    rows = []
    for (n, f), rs in groups.items():
        ckpts = sum(r["checkpoints"] for r in rs)
        tws = [tw for r in rs for tw in r["tws"]]

        def per_ckpt(key: str, rs=rs, ckpts=ckpts) -> float:
            return sum(r[key] * r["checkpoints"] for r in rs) / ckpts if ckpts else float("nan")
        rows.append({
            "N": n, "f": f, "checkpoints": ckpts, "overhead": bc.median([r["overhead"] for r in rs]),
            "overheads": [r["overhead"] for r in rs], "noise": bc.median([r["noise"] for r in rs]),
            "t_iter_s": sum(r["t_iter_s"] for r in rs) / len(rs),
            "tw_s": sum(tws) / len(tws) if tws else float("nan"),
            "tw_max_s": max(tws) if tws else None, "snap_s": per_ckpt("snap_s"),
            "exposed_s": per_ckpt("exposed_s"),
            "verified": None if all(r["verified"] is None for r in rs) else all(r["verified"] in (None, True) for r in rs),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench", help="directory for the regions (private subdir, removed)")
    ap.add_argument("--state-mib", type=float, default=256, help="state size")
    ap.add_argument("--tensors", type=int, default=32, help="number of fp32 tensors in the state")
    ap.add_argument("--t", type=float, default=0.05, help="emulated compute time per iteration (sleep), s")
    ap.add_argument("--iters", type=int, default=60,
                    help="iterations per run (a multiple of every N·f keeps the model exact)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every configuration (rounds over all of them); the table shows the median")
    ap.add_argument("--f", default="1,2,5,10", help="checkpoint intervals to run, comma list")
    ap.add_argument("--n", default="1,2,3", help="max checkpoints in flight to run, comma list")
    ap.add_argument("--q", type=float, default=1.03, help="acceptable slowdown for f* (eq. 3)")
    ap.add_argument("--target", type=float, default=0.03, help="overhead target at the smallest stall-free f")
    ap.add_argument("--own-target", type=float, default=0.01,
                    help="target of ckptfs's own share (overhead − raw floor, paired per round) at the same rows")
    ap.add_argument("--mode", choices=["sync", "overlap", "both"], default="sync")
    ap.add_argument("--peer", choices=["raw", "none"], default="raw",
                    help="raw: run every configuration also with the raw floor (tools/_raw_checkpointer.py: "
                         "copy + O_DIRECT write + fdatasync, nothing else), so ckptfs's own share of the "
                         "overhead is measured in the same run")
    ap.add_argument("--warmup", type=int, default=-1,
                    help="saves before each timed run (default N+2: every slot of the ring written once)")
    ap.add_argument("--calib", type=int, default=3, help="isolated saves for s and T_w0")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: the update leaves a core to the persist workers, as a GPU "
                         "optimizer step would; 0: torch's default)")
    ap.add_argument("--persist-threads", type=int)
    ap.add_argument("--chunk-mib", type=int)
    ap.add_argument("--staging-mib", type=int)
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip loading the last checkpoint of each run and comparing it with the state")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 20 iterations, f∈{1,5}, N∈{1,2}")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    if a.quick:
        a.state_mib, a.iters, a.f, a.n, a.calib = 64, 20, "1,5", "1,2", 2
    fs, ns = ints(a.f), ints(a.n)
    modes = ["sync", "overlap"] if a.mode == "both" else [a.mode]
    systems = ["ckptfs"] + (["raw"] if a.peer == "raw" else [])
    why = bc.cannot_run(a.device)
    if why:
        print(why, file=sys.stderr)
        return 2

    os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="emu-", dir=a.dir)
    if a.threads:
        torch.set_num_threads(a.threads)
    info = bc.machine_info()
    results: dict[str, Any] = {"tool": "train_emulator", "args": vars(a), "machine": info,
                               "filesystem": bc.fs_of(root), "runs": []}
    t_start = time.perf_counter()
    try:
        emu = Emulator(a, root)
        print(f"train_emulator: state {emu.nbytes / bc.MiB:.0f} MiB in {len(emu.tensors)} tensors on {a.device}, "
              f"t(sleep) = {a.t * 1e3:.0f} ms, {a.iters} iterations/run, torch threads {torch.get_num_threads()}, "
              f"{bc.fs_of(root)}, load {info['loadavg'][0]:.2f}", flush=True)
        emu.baseline(3)  # warm the update path
        cal = emu.calibrate()
        print(f"isolated save (N=1): save() {bc.fmt_s(cal['stall_s'])}, durable after {bc.fmt_s(cal['tw0_s'])} "
              f"({emu.nbytes / cal['tw0_s'] / bc.GB:.2f} GB/s)", flush=True)
        # baselines interleaved with the runs: each run is compared with the mean of the
        # baseline just before and just after it (the machine is shared; load drifts)
        bases = [emu.baseline(a.iters)]
        print(f"baseline: {bases[0] / a.iters * 1e3:.1f} ms/iteration", flush=True)
        runs = []
        # whole rounds over the configurations: a slow spell of the shared disk then hits one
        # run of several configurations, not every run of one
        # (the peer right after ckptfs, so both meet the same state of the machine)
        for rnd, mode, n, f, system in itertools.product(range(a.repeat), modes, ns, fs, systems):
            try:
                r = emu.run(n, f, a.iters, mode, system)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                r = {"system": system, "N": n, "f": f, "mode": mode, "failed": f"{type(e).__name__}: {e}"}
            bases.append(emu.baseline(a.iters))
            r["base_loop_s"] = [bases[-2], bases[-1]]
            r["round"] = rnd
            runs.append(r)
            if "failed" in r:
                print(f"  {system:6s} {mode} N={n} f={f}: FAILED {r['failed']}", flush=True)
            else:
                print(f"  {system:6s} {mode} N={n} f={f:>2}: loop {r['loop_s']:.2f} s (baseline {bases[-2]:.2f}/"
                      f"{bases[-1]:.2f} s), {r['checkpoints']} ckpts, T_w {bc.fmt_s(r['tw_s'])}, "
                      f"save() {bc.fmt_s(r['stall_s'])}, update {bc.fmt_s(r['update_s'])} "
                      f"(baseline {bc.fmt_s(emu.last_update_s)}), sleep {bc.fmt_s(r['sleep_s'])} "
                      f"(baseline {bc.fmt_s(emu.last_sleep_s)}), save() call {bc.fmt_s(r['call_s'])}"
                      + (f", ERRORS {r['errors']}" if r["errors"] else "")
                      + ("" if r["verified"] in (None, True) else ", LOAD MISMATCH"), flush=True)
        t_iter = bc.median(bases) / a.iters
        results["baselines_s"] = bases

        for mode in modes:
            done = [r for r in runs if r["mode"] == mode and "failed" not in r]
            for r in done:
                base = sum(r["base_loop_s"]) / 2
                r["t_iter_s"] = base / a.iters
                r["overhead"] = r["loop_s"] / base - 1.0
                r["noise"] = abs(r["base_loop_s"][0] - r["base_loop_s"][1]) / base
            mruns = combine_rounds([r for r in done if r["system"] == "ckptfs"])
            floors = {(r["N"], r["f"]): r for r in combine_rounds([r for r in done if r["system"] == "raw"])}
            raw_by_round = {(r["N"], r["f"], r["round"]): r["overhead"] for r in done if r["system"] == "raw"}
            for r in mruns:
                floor = floors.get((r["N"], r["f"]))
                r["floor"] = floor["overhead"] if floor else None
                r["floor_runs"] = floor["overheads"] if floor else None
                # ckptfs's own share, paired within each round (the raw run right after it met the
                # same state of the machine), then the median over the rounds
                r["own_runs"] = [c["overhead"] - raw_by_round[(c["N"], c["f"], c["round"])] for c in done
                                 if c["system"] == "ckptfs" and (c["N"], c["f"]) == (r["N"], r["f"])
                                 and (c["N"], c["f"], c["round"]) in raw_by_round]
                r["own"] = bc.median(r["own_runs"]) if r["own_runs"] else None
            for r in mruns:
                r["pred"], r["regime"] = predict(r["tw_s"], r["snap_s"], r["N"], r["f"], r["t_iter_s"], a.t, mode)
                r["fits"] = r["tw_s"] <= r["N"] * r["f"] * r["t_iter_s"]
            # target rows: per N, the smallest f whose T_w fits in N·f·t
            for n in ns:
                cand = sorted((r for r in mruns if r["N"] == n and r["fits"]), key=lambda r: r["f"])
                if cand:
                    cand[0]["target_row"] = True
                    cand[0]["target_ok"] = cand[0]["overhead"] <= a.target
                    cand[0]["own_ok"] = None if cand[0]["own"] is None else cand[0]["own"] <= a.own_target
            # f* (eq. 3): T_w(N) = worst (largest) median T_w seen with N in flight
            twn = {}
            for n in ns:
                tw = [r["tw_s"] for r in mruns if r["N"] == n]
                if tw:
                    twn[n] = max(tw)
            fstar = {n: math.ceil(tw / (n * a.q * t_iter)) for n, tw in twn.items()}
            nstar = min(twn, key=lambda n: twn[n] / n) if twn else None

            print()
            print(f"mode {mode}: t = {t_iter * 1e3:.1f} ms/iteration without checkpoints (median of {len(bases)} "
                  f"baseline runs, sleep {a.t * 1e3:.0f} ms + update), state {emu.nbytes / bc.GB:.3f} GB")
            rows = []
            for r in sorted(mruns, key=lambda r: (r["N"], r["f"])):
                mark = ""
                if r.get("target_row"):
                    mark = f"<- target: {'PASS' if r['target_ok'] else 'FAIL'} (<= {a.target * 100:g} %)"
                    if r["own_ok"] is not None:
                        mark += f"; own: {'PASS' if r['own_ok'] else 'FAIL'} (<= {a.own_target * 100:g} %)"
                floor = "-" if r["floor"] is None else f"{r['floor'] * 100:+.1f} %"
                own = "-" if r["own"] is None else (f"{r['own'] * 100:+.1f} %"
                                                    + (f" ({' '.join(f'{o * 100:+.1f}' for o in r['own_runs'])})"
                                                       if len(r["own_runs"]) > 1 else ""))
                rows.append([r["N"], r["f"], r["checkpoints"], f"{r['overhead'] * 100:+.1f} %",
                             " ".join(f"{o * 100:+.1f}" for o in r["overheads"]), floor, own,
                             f"±{r['noise'] * 100:.1f}", f"{r['pred'] * 100:+.1f} %", r["regime"],
                             bc.fmt_s(r["tw_s"]), bc.fmt_s(r["tw_max_s"]),
                             bc.fmt_s(r["N"] * r["f"] * r["t_iter_s"]), bc.fmt_s(r["snap_s"]),
                             bc.fmt_s(r["exposed_s"]), "" if r["verified"] in (None, True) else "MISMATCH", mark])
            print(bc.table(["N", "f", "ckpts", "overhead", "runs", "raw floor", "ckptfs own", "noise", "model", "regime", "T_w mean", "T_w max",
                            "N·f·t", "snapshot", "exposed", "", ""], rows))
            fs_line = ", ".join(f"N={n}: T_w={bc.fmt_s(twn[n])} -> f*={fstar[n]}" for n in sorted(fstar))
            print(f"f* = ceil(T_w/(N·q·t)), q = {a.q}: {fs_line}; N* = argmin T_w/N = {nstar}"
                  + (f" -> f* = {fstar[nstar]}" if nstar is not None else ""))
            results.setdefault("summary", {})[mode] = {
                "t_iter_s": t_iter, "tw_by_n_s": twn, "fstar_by_n": fstar, "nstar": nstar,
                "fstar": fstar.get(nstar) if nstar is not None else None,
                "rows": [{k: v for k, v in r.items() if k != "tws"} for r in mruns]}
        results["calibration"] = cal
        results["runs"] = runs
        print(f"\noverhead: loop time / mean of the baselines run just before and after − 1, median of the "
              f"{a.repeat} run(s) listed under 'runs' (noise: median difference of the two baselines); raw floor: the "
              f"same loop checkpointing with tools/_raw_checkpointer.py (copy + O_DIRECT write + fdatasync, nothing "
              f"else), median of its runs; ckptfs own: overhead − raw floor paired within each round, median over the rounds (each round's in parentheses); model: max(T_w/(N·f·t) − 1, s/(f·t)), s = snapshot time of that run "
              f"(in overlap mode max(0, s − t_sleep)); exposed: mean stall the loop saw per checkpoint. "
              f"wall {time.perf_counter() - t_start:.0f} s")
    finally:
        bc.remove(root)
        gc.collect()
    if a.json:
        bc.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
