"""DCP with ckptfs as its storage against DCP's own FileSystemWriter / FileSystemReader, same run.

W CPU ranks (gloo, one process each) hold an FSDP2-sharded model (a stack of Linear layers of
--mib MiB of fp32 parameters in all) and its AdamW state (twice that again); every round each
method saves the same state once and loads it once (after a page-cache drop), and the ratios are
taken within the round (median over --rounds, worst round printed too):

  dcp.save, ckptfs StorageWriter      vs  dcp.save, FileSystemWriter (+ fsync of its files)
  dcp.load, ckptfs StorageReader      vs  dcp.load, FileSystemReader

    python tools/bench_dist.py --world 2 --mib 256 --rounds 5     # one untimed warm-up round first
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))

import torch  # noqa: E402

import _bench_common as bc  # noqa: E402


def _model(mib: int) -> torch.nn.Module:
    width = 1024
    layers = max(1, mib * (1 << 20) // (4 * width * width))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _rank(rank: int, world: int, args, workdir: str, out) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckptfs
    from ckptfs.testing.ranks import sharded

    model = sharded(_model(args.mib), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    opt.zero_grad()
    model(torch.randn(2, 1024, generator=g)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    store = ckptfs.Store(os.path.join(workdir, "region"))
    samples = []
    for rnd in range(args.warmup + args.rounds):  # warm-up rounds: the first saves into fresh blocks
        row = {}
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "bench", step=rnd))
        dist.barrier()
        row["ckptfs_save"] = time.perf_counter() - t0
        fsdir = os.path.join(workdir, f"fs-{rnd}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(fsdir, sync_files=True))
        if rank == 0:
            _fsync_tree(fsdir)
        dist.barrier()
        row["fs_save"] = time.perf_counter() - t0
        for name, reader in (("ckptfs_load", lambda: ckptfs.dcp.StorageReader(store, "bench")),
                             ("fs_load", lambda: dcp.FileSystemReader(fsdir))):
            if rank == 0:
                bc.drop_caches()
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(state, storage_reader=reader())
            dist.barrier()
            row[name] = time.perf_counter() - t0
        if rank == 0:
            shutil.rmtree(fsdir, ignore_errors=True)
            if rnd >= args.warmup:
                samples.append(row)
    if rank == 0:
        out.put(samples)
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=128, help="fp32 parameters in all (AdamW adds twice that)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (each method's first save "
                    "writes fresh blocks and sets up its writers)")
    ap.add_argument("--dir", default="/tmp/ckptfs-bench")
    args = ap.parse_args()
    import ckptfs
    from ckptfs.testing.load import mp_context
    from ckptfs.testing.ranks import run_ranks

    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_dist-", dir=args.dir)
    try:
        ckptfs.Store.create(os.path.join(workdir, "region"), size_bytes=(args.mib * 3 * 10 + 512) << 20).close()
        out = mp_context().Queue()
        run_ranks(_rank, args.world, args, workdir, out, timeout_s=1800)
        samples = out.get()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    gb = 3 * args.mib * (1 << 20) / 1e9  # parameters + AdamW's two moments (the local shards add up to it)
    print(f"\nbench_dist: W={args.world} CPU ranks (gloo), FSDP2 model of {args.mib} MiB + AdamW ({gb:.2f} GB), "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}")
    print(f"{'figure':44} {'ckptfs':>9} {'FileSystem':>11} {'ratio':>6} {'worst':>6}")
    for what, ck, fs in (("dcp.save (durable), s", "ckptfs_save", "fs_save"),
                         ("dcp.load (cold cache), s", "ckptfs_load", "fs_load")):
        ratios = [r[fs] / r[ck] for r in samples]
        print(f"{what:44} {statistics.median(r[ck] for r in samples):9.3f} "
              f"{statistics.median(r[fs] for r in samples):11.3f} {statistics.median(ratios):6.2f} {min(ratios):6.2f}")
    print("ratio = FileSystem time / ckptfs time (higher is better for ckptfs), median and worst round")


if __name__ == "__main__":
    main()
