#!/usr/bin/env python3
"""A real training loop: what checkpointing every f iterations costs it, ckptfs beside its peers.

GPT-2 (transformers, built from a config: no download; ``--layers`` blocks of ``--width``, GPT-2
small by default) and AdamW on ``--device``, trained on random token batches (``--batch`` x
``--seq``). One iteration is forward, backward, ``opt.step()``, ``zero_grad``. Every f iterations
``{"model": model.state_dict(), "optim": opt.state_dict()}`` is saved, by each method in turn:

| method | how it saves, as its documentation says to |
| --- | --- |
| ckptfs | ``Writer.save(state, step, async_snapshot=True)`` after the step (``max_inflight=N``); the next ``opt.step()`` first waits for that snapshot (``wait_snapshot``), so the copy runs during the next forward/backward |
| raw floor | tools/_raw_checkpointer.py in the same pattern: a copy, O_DIRECT writes and an fdatasync, nothing else (no index, no checksums, no commit): what the host and the disk charge for writing the bytes at all |
| dcp.async_save | ``torch.distributed.checkpoint.async_save`` with a ``FileSystemWriter``; the previous save's future is awaited before the next one (DCP's pattern) |
| torch.save | ``torch.save`` + fsync in the loop (synchronous) |

overhead = the loop's time / the mean of the no-checkpoint loops run just before and after − 1;
medians over ``--rounds`` (worst printed too). Which rows any checkpointer can hide at all: with
T_w the time one save takes to be durable (measured alone), T_b the time per save of saves made
back to back with N in flight (the device's sustained rate) and t the iteration time, a save every
f iterations keeps up only where T_w <= N·f·t (PCcheck §3.4: N in flight hide one save's latency)
and T_b <= f·t (the device absorbs a save per interval: on a disk that one save already saturates,
N in flight share its bandwidth, T_b ≈ T_w, and N hides nothing in the steady state); elsewhere the
disk, not the checkpointer, sets the overhead. Targets (issue 13 §4, §5), at each f where the disk
keeps up: ckptfs's overhead <= 3 %, and ckptfs's own share (its overhead − the raw floor's, paired
within a round) <= 1 %. A loop's time leaves out the drain after it (printed): the last N saves
are still in flight when it ends.
The last save of each ckptfs run is loaded and compared with the trained state.

    python tools/bench_train.py --device cuda                      # GPT-2 small, f = 1, 5
    python tools/bench_train.py --device cuda --batch 16 --f 1,2,4 --rounds 5
    python tools/bench_train.py --layers 1 --width 64 --vocab 1000 --seq 32 --iters 4 --f 1,2 --rounds 1
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))

import torch  # noqa: E402

import _bench_common as bc  # noqa: E402
from _raw_checkpointer import RawCheckpointer  # noqa: E402

METHODS = ["ckptfs", "raw", "dcp_async", "torch_save"]
LABELS = {"ckptfs": "ckptfs (async snapshot)", "raw": "raw floor (copy + O_DIRECT)",
          "dcp_async": "dcp.async_save FileSystemWriter", "torch_save": "torch.save + fsync"}


class Trainer:
    """The model, its optimizer and a fixed batch on one device; ``state()`` is what is saved."""

    def __init__(self, a: argparse.Namespace):
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.device = a.device
        cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64), vocab_size=a.vocab,
                         n_positions=max(a.seq, 64), bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(cfg).to(a.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
        self.step(None)  # AdamW makes its state: the saved structure is the same from here on
        self.nbytes = bc.state_nbytes(self.state())

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def step(self, before_update) -> None:
        """One iteration; ``before_update()`` runs between backward and the optimizer's step."""
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        if before_update is not None:
            before_update()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def loop(self, iters: int, f: int | None = None, saver=None) -> float:
        """Seconds for ``iters`` iterations, ``saver.save(step)`` after every f-th (and its
        ``before_update`` hook before every step); the device is synchronized at both ends."""
        bc.cuda_sync(self.device)
        t0 = time.perf_counter()
        for i in range(iters):
            self.step(saver.before_update if saver else None)
            if saver and (i + 1) % f == 0:
                saver.save(i + 1)
        bc.cuda_sync(self.device)
        return time.perf_counter() - t0


class _Saver:
    """One method's saves in the loop: ``save(step)``, ``before_update()``, ``drain()``."""

    def __init__(self, trainer: Trainer, root: str, n: int):
        self.t, self.root, self.n = trainer, root, n

    def before_update(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def verify(self) -> bool | None:
        return None


class CkptfsSaver(_Saver):
    def __init__(self, trainer, root, n, writer_kw):
        super().__init__(trainer, root, n)
        import ckptfs

        self.path = os.path.join(root, "region")
        size = (int(trainer.nbytes * (n + 4) * 1.15) + (256 << 20)) // bc.MiB * bc.MiB
        self.store = ckptfs.Store.create(self.path, size_bytes=size)
        self.w = self.store.writer("train", max_inflight=n, **writer_kw)
        self.pending = False
        self.seq = 0
        for _ in range(n + 2):  # every slot of the ring written once: the steady state
            self.save(0)
        self.drain()

    def save(self, step: int) -> None:
        self.seq += 1
        self.w.save(self.t.state(), step=self.seq, async_snapshot=True)
        self.pending = True

    def before_update(self) -> None:
        if self.pending:
            self.w.wait_snapshot()  # the step must not change what is being copied
            self.pending = False

    def drain(self) -> None:
        self.w.wait()
        self.pending = False

    def verify(self) -> bool:
        return bc.states_equal(self.store.load("train"), self.t.state())

    def close(self) -> None:
        self.w.close()
        self.store.close()


class RawSaver(_Saver):
    def __init__(self, trainer, root, n, writer_kw):
        super().__init__(trainer, root, n)
        tensors = list({id(x): x for x in bc.iter_tensors(trainer.state())}.values())
        self.raw = RawCheckpointer(tensors, n, os.path.join(root, "raw"))
        self.pending = False
        for _ in range(n + 1):  # every slot written once
            self.raw.save(None, 0)
        self.raw.wait()

    def save(self, step: int) -> None:
        self.raw.save(None, step, async_snapshot=True)
        self.pending = True

    def before_update(self) -> None:
        if self.pending:
            self.raw.wait_snapshot()
            self.pending = False

    def drain(self) -> None:
        self.raw.wait()

    def close(self) -> None:
        self.raw.close()


class DcpAsyncSaver(_Saver):
    def __init__(self, trainer, root, n, writer_kw):
        super().__init__(trainer, root, n)
        self.future = None
        self.seq = 0

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.future is not None:
            self.future.result()  # DCP's pattern: one async save at a time
        self.seq += 1
        path = os.path.join(self.root, f"dcp-{self.seq}")
        self.future = dcp.async_save(self.t.state(), storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        old = os.path.join(self.root, f"dcp-{self.seq - 2}")
        shutil.rmtree(old, ignore_errors=True)  # keep two, as a ring would

    def drain(self) -> None:
        if self.future is not None:
            self.future.result()


class TorchSaver(_Saver):
    def __init__(self, trainer, root, n, writer_kw):
        super().__init__(trainer, root, n)
        self.seq = 0

    def save(self, step: int) -> None:
        self.seq += 1
        path = os.path.join(self.root, f"ckpt-{self.seq % 2}.pt")
        torch.save(self.t.state(), path)
        bc.fsync_path(path)


SAVERS = {"ckptfs": CkptfsSaver, "raw": RawSaver, "dcp_async": DcpAsyncSaver, "torch_save": TorchSaver}


def measure(trainer: Trainer, a, root: str, method: str, f: int, writer_kw: dict) -> dict:
    """One run of ``method`` at ``f``, between two no-checkpoint loops."""
    before = trainer.loop(a.iters)
    work = tempfile.mkdtemp(prefix=f"{method}-", dir=root)
    saver = SAVERS[method](trainer, work, a.n, writer_kw)
    try:
        loop_s = trainer.loop(a.iters, f, saver)
        t0 = time.perf_counter()
        saver.drain()
        drain_s = time.perf_counter() - t0
        verified = saver.verify() if a.iters % f == 0 else None
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)
    after = trainer.loop(a.iters)
    base = (before + after) / 2
    return {"method": method, "f": f, "loop_s": loop_s, "base_s": base, "overhead": loop_s / base - 1,
            "noise": abs(before - after) / base, "drain_s": drain_s, "verified": verified}


def save_times(trainer: Trainer, root: str, a, writer_kw: dict) -> tuple[float, float]:
    """(T_w, T_b): seconds for one ckptfs save to be durable with nothing else running (median of
    3), and seconds per save of 2N + 2 saves made back to back with N in flight, until the last is
    durable (the rate the device sustains)."""
    saver = CkptfsSaver(trainer, tempfile.mkdtemp(prefix="tw-", dir=root), a.n, writer_kw)
    try:
        times = []
        for step in range(3):
            bc.cuda_sync(a.device)
            t0 = time.perf_counter()
            saver.w.save(trainer.state(), step=100 + step).result()
            times.append(time.perf_counter() - t0)
        count = 2 * a.n + 2
        bc.cuda_sync(a.device)
        t0 = time.perf_counter()
        for step in range(count):
            saver.w.save(trainer.state(), step=200 + step)
        saver.w.wait()
        return bc.median(times), (time.perf_counter() - t0) / count
    finally:
        saver.close()


def keeps_up(f: int, t_iter: float, tw: float, tb: float, n: int) -> float:
    """How far the disk is from keeping up with a save every f iterations: the larger of
    T_w / (N·f·t) and T_b / (f·t); it keeps up where this is <= 1."""
    return max(tw / (n * f * t_iter), tb / (f * t_iter))


def summarize(rows: list[dict], methods: list[str], fs: list[int], t_iter: float, tw: float, tb: float,
              n: int) -> list[dict]:
    """One line per f: each method's median and worst overhead, ckptfs's own share (its overhead
    minus the raw floor's, paired within each round), whether the disk keeps up (``keeps_up``)
    and, where it does, the verdict on the targets."""
    out = []
    for f in fs:
        by = {m: [r for r in rows if r["method"] == m and r["f"] == f] for m in methods}
        line = {"f": f, "median": {}, "worst": {}, "own_runs": [], "own": None}
        for m in methods:
            if by[m]:
                line["median"][m] = bc.median([r["overhead"] for r in by[m]])
                line["worst"][m] = max(r["overhead"] for r in by[m])
        if by.get("ckptfs") and by.get("raw"):
            line["own_runs"] = [c["overhead"] - r["overhead"] for c, r in zip(by["ckptfs"], by["raw"])]
            line["own"] = bc.median(line["own_runs"])
        line["disk_load"] = keeps_up(f, t_iter, tw, tb, n)
        line["keeps_up"] = line["disk_load"] <= 1
        line["verdict"] = None
        if line["keeps_up"] and "ckptfs" in line["median"]:
            line["verdict"] = line["median"]["ckptfs"] <= 0.03 and (line["own"] is None or line["own"] <= 0.01)
        out.append(line)
    return out


def report(summary: list[dict], rows: list[dict], methods: list[str], t_iter: float, tw: float, tb: float,
           n: int) -> None:
    print(f"\niteration t = {1e3 * t_iter:.1f} ms without checkpoints; one save durable alone T_w = "
          f"{1e3 * tw:.0f} ms; back to back T_b = {1e3 * tb:.0f} ms a save; N = {n} in flight")
    head = ["f"] + [LABELS[m] for m in methods] + ["own (ckptfs − raw)", "disk keeps up", "target"]
    table = []
    for line in summary:
        med, worst = line["median"], line["worst"]
        cells = [str(line["f"])]
        cells += [f"{100 * med[m]:+.1f} % (worst {100 * worst[m]:+.1f})" if m in med else "-" for m in methods]
        cells.append("-" if line["own"] is None else f"{100 * line['own']:+.1f} %")
        cells.append("yes" if line["keeps_up"] else f"no: {line['disk_load']:.1f}x")
        if line["verdict"] is None:
            cells.append("info (the disk sets it)")
        else:
            cells.append(("PASS" if line["verdict"] else "FAIL") + " (<= 3 %, own <= 1 %)")
        table.append(cells)
    print(bc.table(head, table))
    print("overhead: the loop's time / the mean of the no-checkpoint loops just before and after − 1, median "
          "over the rounds; own: paired within each round; the disk keeps up where T_w <= N·f·t (PCcheck §3.4) "
          "and T_b <= f·t (its sustained rate), elsewhere no checkpointer can hide it")
    bad = [r for r in rows if r["verified"] is False]
    print("ckptfs's last save of every run equals the trained state" if not bad else
          f"VERIFY FAILED: {len(bad)} run(s) loaded something else")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20, help="iterations per loop (a multiple of each f)")
    ap.add_argument("--f", default="1,5", help="checkpoint every f iterations, comma list")
    ap.add_argument("--n", type=int, default=2, help="saves in flight (ckptfs max_inflight, the raw floor's buffers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--persist-threads", type=int)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    fs = [int(x) for x in a.f.split(",") if x.strip()]
    methods = [m for m in a.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    why = bc.cannot_run(a.device)
    if why:
        print(why, file=sys.stderr)
        return 2
    os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="train-", dir=a.dir)
    writer_kw = bc.writer_kwargs(persist_threads=a.persist_threads)
    try:
        trainer = Trainer(a)
        print(f"GPT-2 {a.layers}x{a.width}, vocab {a.vocab}, batch {a.batch}x{a.seq} on {a.device}: "
              f"{trainer.nbytes / 1e9:.3f} GB saved per checkpoint; {bc.fs_of(root)}")
        trainer.loop(2)  # warm-up: kernels, allocator
        t_iter = trainer.loop(a.iters) / a.iters
        tw, tb = save_times(trainer, root, a, writer_kw)
        rows = []
        for rnd in range(a.rounds):
            for f in fs:
                for m in methods:
                    try:
                        r = measure(trainer, a, root, m, f, writer_kw)
                    except Exception as e:  # noqa: BLE001 - one method's failure is a row, not the end
                        traceback.print_exc()
                        print(f"  [{rnd + 1}] {m} f={f}: FAILED {type(e).__name__}: {e}")
                        continue
                    rows.append(r)
                    print(f"  [{rnd + 1}] f={f:<3} {LABELS[m]:34} loop {r['loop_s']:7.3f} s  base "
                          f"{r['base_s']:7.3f} s  overhead {100 * r['overhead']:+6.1f} %  drain {r['drain_s']:.2f} s"
                          + ("" if r["verified"] is None else f"  verified={r['verified']}"), flush=True)
        summary = summarize(rows, methods, fs, t_iter, tw, tb, a.n)
        report(summary, rows, methods, t_iter, tw, tb, a.n)
        if a.json:
            bc.write_json(a.json, {"machine": bc.machine_info(), "args": vars(a), "t_iter_s": t_iter, "tw_s": tw, "tb_s": tb,
                                   "bytes": trainer.nbytes, "rows": rows, "summary": summary})
        return 1 if any(r["verified"] is False for r in rows) else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
