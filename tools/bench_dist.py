"""Many ranks, one checkpoint: ckptfs against DCP's own FileSystemWriter / FileSystemReader and the
raw device, in the same run, at each world size W.

W ranks (one process each: CPU ranks on gloo, or with --device cuda one per GPU, NCCL for the
model and gloo for the checkpoint) train a GPT-2 (transformers, from a config: --layers blocks of
width --width; 12 x 768 is GPT-2 small) under FSDP2 (``fully_shard`` per block) with AdamW; every
round each method saves the same state (model + optimizer, each rank its shards), and the ratios
are taken within the round (median over --rounds, worst round printed too):

| row | what is timed (every method bracketed by barriers; times are the slowest rank's) |
| --- | --- |
| copy floor | a ``copy_`` of each of the rank's local tensors into tensors made beforehand (pinned host memory with --device cuda: the device-to-host copy) |
| ckptfs writer | ``store.writer(group=WORLD).save(state, step)``, in the steady state (after N+4 untimed saves: every slot it cycles through written once, as the raw overwrite's blocks are): stall (until save returns: the copy), durable (until the step is the global latest on every node), global commit (from the last rank's part durable to every node recorded) |
| dcp.save + ckptfs | ``dcp.save`` with ``ckptfs.dcp.StorageWriter``: durable |
| dcp.async_save + ckptfs | its stall (until it returns) and durable (its future) |
| dcp.save + FileSystemWriter | ``sync_files=True`` and an fsync of every file: durable |
| dcp.async_save + FileSystemWriter | stall and durable |
| raw O_DIRECT overwrite | each rank writes its state's bytes into a file of its own written once before, fdatasync; with 1 and with 2 writes in flight per rank (the writer's persist threads); the target takes the faster |

Then the state saved at the largest W is loaded at W/2 (resharded; after a page-cache drop, and
ckptfs's store opened in the round, as drop_caches leaves the pages a process has mapped):
``dcp.load`` with ckptfs's StorageReader against FileSystemReader, and the floor: each rank an
O_DIRECT read of an equal share of the same bytes (DCP's files). Targets (issue 14): aggregate
durable throughput >= 0.9 x raw overwrite; >= 3 x dcp.save with FileSystemWriter; stall <= 1.25 x
the copy floor; global commit <= 50 ms; resharded load >= 2 x DCP's.

    python tools/bench_dist.py --worlds 1,2,4 --rounds 5            # GPT-2 small, 1.5 GB per save
    python tools/bench_dist.py --worlds 1,2 --layers 2 --rounds 2   # a quick run
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
import _raw_io as raw  # noqa: E402

MODEL = "bench"
RAW_THREADS = 2  # the writer's persist threads (DEFAULT_PERSIST_THREADS)
# The region (sparse: what the saves write of it) holds this many copies of the whole state: its
# three models' rings of N+2 slots of every rank's part, with the writer's headroom, and the
# versions kept for the loads; at least REGION_MIN_BYTES. A fixed 24 GiB left GPT-2 small just
# enough and made the CI's tiny model ask for 24 GiB of free disk.
REGION_STATES = 18
REGION_MIN_BYTES = 1 << 30


def _model(args, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64)))
    model = model.to(args.device)  # cuda: the rank's own GPU (run_ranks set it)
    mesh = init_device_mesh(args.device, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _state_bytes(args) -> int:
    """The bytes of one save of the whole state (all ranks): the model's fp32 parameters and
    AdamW's two moments, counted on the meta device (nothing allocated)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64)))
    return 3 * sum(p.numel() * 4 for p in model.parameters())


def _region_bytes(args) -> int:
    return max(REGION_MIN_BYTES, REGION_STATES * _state_bytes(args))


def _state(args, world: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(args, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0)).to(args.device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # AdamW makes its state
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _local_tensors(state) -> list[torch.Tensor]:
    out = []
    for t in bc.iter_tensors(state):
        out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out


def _timed(fn, group) -> float:
    """The slowest rank's time of ``fn`` (barriers before and after)."""
    import torch.distributed as dist

    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group)
    return time.perf_counter() - t0


def _save_rank(rank, world, args, workdir, out, keep: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptfs
    from ckptfs.dist.group import coordination

    gloo = coordination(600, MODEL, "bench")
    state = _state(args, world)
    local = _local_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in local)
    # the floor: a copy of the rank's tensors into memory made beforehand (pinned host memory
    # for CUDA tensors: the device-to-host copy any checkpoint of them makes)
    cuda = args.device == "cuda"
    floor_dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in local]

    def floor_copy():
        for d, src in zip(floor_dst, local):
            d.copy_(src, non_blocking=cuda)
        bc.cuda_sync(args.device)
    raw_path = os.path.join(workdir, f"raw-{rank}")
    raw_buf = raw.AlignedBuffer(8 << 20)
    raw.odirect_write(raw_path, nbytes, raw_buf)  # written once: the rounds overwrite
    store = ckptfs.Store(os.path.join(workdir, f"region-{world}"))
    samples = []
    with store.writer(MODEL, group=dist.group.WORLD, max_inflight=2, timeout_s=600) as w:
        # The steady state, as bench_save measures it: every slot the writer's saves cycle
        # through written once (the ring's N+2 slots of each part model, and the slots taken
        # in place of the parts kept until their global commit), so the timed saves overwrite
        # allocated blocks, as the raw overwrite does; the first writes into the sparse region's
        # fresh blocks are not what a job pays save after save.
        primed = 0 if args.warmup == 0 else w.max_inflight + 4
        for step in range(1, primed + 1):
            w.save(state, step=step).result()
        for rnd in range(args.warmup + args.rounds):
            row, step = {}, primed + rnd + 1
            row["floor"] = _timed(floor_copy, gloo)
            holder = {}

            def writer_save():
                t0 = time.perf_counter()
                f = w.save(state, step=step)
                holder["stall"] = time.perf_counter() - t0
                holder["result"] = f.result()
            row["w_durable"] = _timed(writer_save, gloo)
            row["w_stall"] = _max(holder["stall"], gloo)
            marks = [None] * world
            dist.all_gather_object(marks, (holder["result"].part_durable_at, holder["result"].committed_at), group=gloo)
            row["w_commit"] = max(c for _, c in marks) - max(p for p, _ in marks)
            row["dcp_ck"] = _timed(lambda: dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(
                store, MODEL + "-dcp", step=step), process_group=gloo), gloo)

            def async_save(writer):
                t0 = time.perf_counter()
                f = dcp.async_save(state, storage_writer=writer, process_group=gloo)
                holder["stall"] = time.perf_counter() - t0
                f.result()
            row["adcp_ck"] = _timed(lambda: async_save(ckptfs.dcp.StorageWriter(store, MODEL + "-async", step=step)),
                                    gloo)
            row["adcp_ck_stall"] = _max(holder["stall"], gloo)
            fsdir = os.path.join(workdir, f"fs-{world}-{rnd}")

            def fs_save():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(fsdir, sync_files=True), process_group=gloo)
                if rank == 0:
                    bc.fsync_tree(fsdir)
            row["dcp_fs"] = _timed(fs_save, gloo)
            afsdir = fsdir + "-async"
            row["adcp_fs"] = _timed(lambda: async_save(dcp.FileSystemWriter(afsdir, sync_files=True)), gloo)
            row["adcp_fs_stall"] = _max(holder["stall"], gloo)
            row["raw1"] = _timed(lambda: raw.odirect_write(raw_path, nbytes, raw_buf, overwrite=True), gloo)
            # as many writes in flight per rank as the writer's persist threads: the device's
            # ceiling is the faster of the two (a virtual disk may need the queue depth)
            row["raw2"] = _timed(lambda: raw.odirect_write(raw_path, nbytes, raw_buf, threads=RAW_THREADS,
                                                          overwrite=True), gloo)
            row["raw"] = min(row["raw1"], row["raw2"])
            row["bytes"] = _sum(nbytes, gloo)
            dist.barrier(gloo)
            if rank == 0:
                shutil.rmtree(afsdir, ignore_errors=True)
                if not (keep and rnd == args.warmup + args.rounds - 1):
                    shutil.rmtree(fsdir, ignore_errors=True)
                else:
                    os.rename(fsdir, os.path.join(workdir, "fs-kept"))
            if rnd >= args.warmup:
                samples.append(row)
    raw_buf.close()
    os.unlink(raw_path)
    if rank == 0:
        out.put(samples)
    store.close()


def _load_rank(rank, world, args, workdir, saved_world, out) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptfs
    from ckptfs.dist.group import coordination
    from ckptfs.gcpause import paused_gc

    gloo = coordination(600, MODEL, "bench")
    state = _state(args, world)
    region = os.path.join(workdir, f"region-{saved_world}")
    samples = []

    def ckptfs_load():
        # a store of its own per round, as a restarted job opens it: a store kept open keeps
        # the region's pages it mapped in the page cache, and drop_caches leaves mapped pages
        with ckptfs.Store(region) as store:
            dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(store, MODEL, group=gloo), process_group=gloo)

    def ckptfs_own_load():  # the same through ckptfs's API: DCP's planning inside, the GC paused
        with ckptfs.Store(region) as store:
            store.load(MODEL, group=dist.group.WORLD, into=state)

    def fs_load():
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(workdir, "fs-kept")), process_group=gloo)

    def fs_load_gc_paused():
        with paused_gc():
            fs_load()

    fs_dir = os.path.join(workdir, "fs-kept")
    files = sorted(os.path.join(fs_dir, f) for f in os.listdir(fs_dir) if f.endswith(".distcp"))
    mine = files[rank::world]  # the floor: the same bytes, each rank an equal share, O_DIRECT
    raw_buf = raw.AlignedBuffer(8 << 20)

    def raw_read():
        for f in mine:
            raw.odirect_read(f, os.path.getsize(f) // 4096 * 4096, raw_buf)

    for _ in range(args.rounds):
        row = {}
        for name, load in (("raw", raw_read), ("ck", ckptfs_load), ("fs", fs_load), ("ck_own", ckptfs_own_load),
                           ("fs_nogc", fs_load_gc_paused)):
            dist.barrier(gloo)
            if rank == 0:
                bc.drop_caches()
            row[name] = _timed(load, gloo)
        samples.append(row)
    raw_buf.close()
    if rank == 0:
        out.put(samples)


def _max(x: float, group) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _sum(x: int, group) -> int:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t)


def _med(rows, f) -> tuple[float, float]:
    """(median, worst) of f(row) over the rounds; worst = the largest (a time or a time ratio)."""
    xs = [f(r) for r in rows]
    return statistics.median(xs), max(xs)


def _report(world: int, rows: list[dict]) -> None:
    gb = rows[0]["bytes"] / 1e9
    print(f"\nW={world}: {gb:.3f} GB per save (model + AdamW, all ranks), {len(rows)} rounds")
    print(f"{'figure':58} {'median':>9} {'worst':>9}  target")

    def line(what, f, target="", fmt="{:9.3f}"):
        m, worst = _med(rows, f)
        print(f"{what:58} {fmt.format(m)} {fmt.format(worst)}  {target}")
    line("copy floor, s", lambda r: r["floor"])
    line("ckptfs writer stall / copy floor", lambda r: r["w_stall"] / r["floor"], "<= 1.25")
    line("ckptfs writer durable, s", lambda r: r["w_durable"])
    line("ckptfs writer global commit after the last part, ms", lambda r: 1e3 * r["w_commit"], "<= 50")
    line("raw O_DIRECT overwrite (the faster) / ckptfs writer durable", lambda r: r["raw"] / r["w_durable"], ">= 0.9")
    line("dcp.save FileSystemWriter / ckptfs writer durable", lambda r: r["dcp_fs"] / r["w_durable"], ">= 3")
    line("dcp.save FileSystemWriter / dcp.save ckptfs", lambda r: r["dcp_fs"] / r["dcp_ck"])
    line("dcp.async_save FS / dcp.async_save ckptfs (durable)", lambda r: r["adcp_fs"] / r["adcp_ck"])
    line("dcp.async_save stall, ckptfs storage, s", lambda r: r["adcp_ck_stall"])
    line("dcp.async_save stall, FileSystemWriter, s", lambda r: r["adcp_fs_stall"])
    line("aggregate durable GB/s: ckptfs writer", lambda r: r["bytes"] / 1e9 / r["w_durable"])
    line("aggregate GB/s: raw overwrite, 1 write in flight per rank", lambda r: r["bytes"] / 1e9 / r["raw1"])
    line(f"aggregate GB/s: raw overwrite, {RAW_THREADS} writes in flight per rank",
         lambda r: r["bytes"] / 1e9 / r["raw2"])
    print("(ratios of times are peer / ckptfs: higher is better for ckptfs; 'worst' is the largest value)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (fresh blocks, writers set up)")
    ap.add_argument("--dir", default="/tmp/ckptfs-bench")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the ranks' state lives (cuda: one rank per GPU, NCCL for the model)")
    args = ap.parse_args()
    import ckptfs
    from ckptfs.testing.load import mp_context
    from ckptfs.testing.ranks import run_ranks

    worlds = [int(w) for w in args.worlds.split(",")]
    backend = "gloo"
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if not gpus or max(worlds) > gpus:
            sys.exit(f"--device cuda: one rank per GPU, and this machine has {gpus}: pass --worlds up to {gpus}")
        backend = "cpu:gloo,cuda:nccl"
    os.makedirs(args.dir, exist_ok=True)
    # the region (its three models' slots fill it), DCP's two FileSystemWriter copies and the raw file
    bc.require_free(args.dir, _region_bytes(args) + 3 * _state_bytes(args), "bench_dist")
    workdir = tempfile.mkdtemp(prefix="bench_dist-", dir=args.dir)
    print(f"bench_dist: GPT-2 {args.layers} x {args.width} under FSDP2 + AdamW, ranks on {args.device} "
          f"({'one GPU each, NCCL for the model, ' if args.device == 'cuda' else ''}gloo for the checkpoint); "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    try:
        for world in worlds:
            ckptfs.Store.create(os.path.join(workdir, f"region-{world}"), size_bytes=_region_bytes(args)).close()
            out = mp_context().Queue()
            run_ranks(_save_rank, world, args, workdir, out, world == max(worlds), timeout_s=3600, backend=backend)
            _report(world, out.get())
            if world != max(worlds):  # only the largest W's checkpoints are loaded below
                os.unlink(os.path.join(workdir, f"region-{world}"))
        saved, to = max(worlds), max(1, max(worlds) // 2)
        out = mp_context().Queue()
        run_ranks(_load_rank, to, args, workdir, saved, out, timeout_s=3600, backend=backend)
        rows = out.get()
        print(f"\nload of the W={saved} checkpoint at W={to} (resharded), cold cache, {len(rows)} rounds")
        m, worst = _med(rows, lambda r: r["fs"] / r["ck"])
        print(f"dcp.load FileSystemReader / ckptfs StorageReader: median {m:.2f}, lowest "
              f"{min(r['fs'] / r['ck'] for r in rows):.2f}  (target >= 2); ckptfs "
              f"{statistics.median(r['ck'] for r in rows):.3f} s, FS {statistics.median(r['fs'] for r in rows):.3f} s")
        m, _ = _med(rows, lambda r: r["fs"] / r["ck_own"])
        print(f"dcp.load FileSystemReader / store.load(group=, into=): median {m:.2f}, lowest "
              f"{min(r['fs'] / r['ck_own'] for r in rows):.2f}  (target >= 2); ckptfs "
              f"{statistics.median(r['ck_own'] for r in rows):.3f} s")
        m, _ = _med(rows, lambda r: r["fs_nogc"] / r["ck_own"])
        print(f"info: the same with FileSystemReader's load under a paused GC too: median {m:.2f} "
              f"(FS {statistics.median(r['fs_nogc'] for r in rows):.3f} s; a gen-2 collection of a rank's heap "
              "comes in most loads of either kind while the GC runs)")
        m, _ = _med(rows, lambda r: r["raw"] / r["ck"])
        print(f"raw O_DIRECT read of the same bytes (the disk's floor) / ckptfs StorageReader: median {m:.2f} "
              f"(raw {statistics.median(r['raw'] for r in rows):.3f} s)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
