"""Shared helpers of the benchmark tools (``bench_save.py``, ``train_emulator.py``).

Nothing here belongs to the library: these are the states the tools checkpoint, the raw-I/O
baselines every ckptfs figure is compared with, and small timing / formatting helpers.
GB means 10**9 bytes everywhere (GB/s as in DESIGN.md); GiB/MiB are used for sizes given on the
command line.
"""
from __future__ import annotations

import mmap
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30
ALIGN = 4096  # O_DIRECT alignment of buffer address, file offset and length


def require_free(path: str, need_bytes: int, tool: str) -> None:
    """Exit with one line where the filesystem of ``path`` has less than ``need_bytes`` free: a
    peer that runs out of space mid-run says so in its own words, if at all (torch.save, under
    DCP's FileSystemWriter: "unexpected pos 704 vs 598")."""
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        sys.exit(f"{tool} needs about {need_bytes / GB:.0f} GB free in {path} and its filesystem has "
                 f"{free / GB:.0f} GB: free some space, or pass --dir on a larger filesystem")


# --------------------------------------------------------------------------------------------
# page cache


def drop_caches() -> bool:
    """``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``; False (and no error) when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories themselves (what a durable save needs)."""
    if os.path.isfile(path):
        fsync_path(path)
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------
# states


def _fill_random_(tensors: list[torch.Tensor], seed: int = 0) -> None:
    """Fill float tensors with pseudo-random values fast: copies out of one 64 MiB random block
    (random enough that no layer below can compress or deduplicate it)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.empty(16 * MiB, dtype=torch.float32).uniform_(-1, 1, generator=g)
    pos = 0
    for t in tensors:
        flat = t.view(-1)
        done = 0
        n = flat.numel()
        while done < n:
            take = min(n - done, src.numel() - pos)
            flat[done:done + take].copy_(src[pos:pos + take].to(t.dtype))
            done += take
            pos = (pos + take + 977) % (src.numel() - 1024)  # drift so tensors differ


def make_flat_state(total_bytes: int, n_tensors: int = 100, device: str = "cpu",
                    seed: int = 0) -> "OrderedDict[str, torch.Tensor]":
    """About ``n_tensors`` fp32 tensors of varied sizes (1x..2x), ``total_bytes`` in all (to 4 bytes)."""
    total = total_bytes // 4
    weights = [1.0 + (i * 7 % 11) / 10.0 for i in range(n_tensors)]
    ws = sum(weights)
    sizes = [max(1, int(total * w / ws)) for w in weights]
    sizes[-1] += total - sum(sizes)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for i, n in enumerate(sizes):
        # 2-D where it divides evenly, like real weights
        cols = 1024 if n % 1024 == 0 else 1
        state[f"layer{i:03d}.weight"] = torch.empty((n // cols, cols) if cols > 1 else (n,),
                                                    dtype=torch.float32)
    _fill_random_(list(state.values()), seed)
    if device != "cpu":
        state = OrderedDict((k, v.to(device)) for k, v in state.items())
    return state


def gpt2_shapes(n_layer: int = 12, vocab: int = 50257, n_ctx: int = 1024,
                d: int = 768) -> "OrderedDict[str, tuple[int, ...]]":
    """Parameter names and shapes of Hugging Face GPT-2 (small: 124,439,808 parameters;
    ``lm_head`` is tied to ``wte`` and not listed, Conv1D weights are (in, out))."""
    s: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    s["transformer.wte.weight"] = (vocab, d)
    s["transformer.wpe.weight"] = (n_ctx, d)
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        s[p + "ln_1.weight"] = (d,)
        s[p + "ln_1.bias"] = (d,)
        s[p + "attn.c_attn.weight"] = (d, 3 * d)
        s[p + "attn.c_attn.bias"] = (3 * d,)
        s[p + "attn.c_proj.weight"] = (d, d)
        s[p + "attn.c_proj.bias"] = (d,)
        s[p + "ln_2.weight"] = (d,)
        s[p + "ln_2.bias"] = (d,)
        s[p + "mlp.c_fc.weight"] = (d, 4 * d)
        s[p + "mlp.c_fc.bias"] = (4 * d,)
        s[p + "mlp.c_proj.weight"] = (4 * d, d)
        s[p + "mlp.c_proj.bias"] = (d,)
    s["transformer.ln_f.weight"] = (d,)
    s["transformer.ln_f.bias"] = (d,)
    return s


def make_gpt2_adamw_state(device: str = "cpu", n_layer: int = 12, vocab: int = 50257,
                          seed: int = 0) -> dict[str, Any]:
    """``{"model": state_dict, "optim": AdamW.state_dict(), "step": 1}`` for GPT-2 small shapes.

    The optimizer state comes from a real ``torch.optim.AdamW`` step (so it has the exact nested
    structure training code checkpoints: int keys, tuples, floats, bools, None, scalar ``step``
    tensors), with exp_avg / exp_avg_sq filled with random values so nothing compresses."""
    shapes = gpt2_shapes(n_layer=n_layer, vocab=vocab)
    params = OrderedDict((k, torch.empty(s, dtype=torch.float32)) for k, s in shapes.items())
    _fill_random_(list(params.values()), seed)
    plist = [torch.nn.Parameter(v.to(device)) for v in params.values()]
    del params
    opt = torch.optim.AdamW(plist, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for p in plist:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in plist:
        p.grad = None
    # moments: random, like after some training
    moments = []
    for st in opt.state.values():
        moments += [st["exp_avg"], st["exp_avg_sq"]]
    _fill_random_(moments, seed + 1)
    for st in opt.state.values():
        st["exp_avg_sq"].abs_()
    model = OrderedDict((k, p.detach()) for k, p in zip(shapes, plist))
    return {"model": model, "optim": opt.state_dict(), "step": 1}


def iter_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def state_nbytes(obj: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in iter_tensors(obj):
        key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def flatten_tensors(obj: Any, prefix: str = "") -> "OrderedDict[str, torch.Tensor]":
    """Dotted name -> tensor (non-tensor leaves dropped): what safetensors can store."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    if isinstance(obj, torch.Tensor):
        out[prefix.rstrip(".")] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_tensors(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_tensors(v, f"{prefix}{i}."))
    return out


def clone_like(obj: Any, device: str | None = None, pin: bool = False) -> Any:
    """Preallocated destination with the same structure (for the memcpy / D2H baselines)."""
    if isinstance(obj, torch.Tensor):
        dev = device or obj.device
        return torch.empty(obj.shape, dtype=obj.dtype, device=dev, pin_memory=pin)
    if isinstance(obj, dict):
        return type(obj)((k, clone_like(v, device, pin)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_like(v, device, pin) for v in obj)
    return obj


def copy_state_(dst: Any, src: Any, non_blocking: bool = False) -> None:
    for d, s in zip(iter_tensors(dst), iter_tensors(src)):
        d.copy_(s, non_blocking=non_blocking)


def states_equal(a: Any, b: Any) -> bool:
    """Same tensor names (dotted paths), shapes, dtypes and bytes."""
    fa, fb = flatten_tensors(a), flatten_tensors(b)
    if fa.keys() != fb.keys():
        return False
    for k, x in fa.items():
        y = fb[k]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.cpu(), y.cpu()):
            return False
    return True


def cuda_sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# raw I/O baselines


class AlignedBuffer:
    """Page-aligned private anonymous buffer filled with random bytes (O_DIRECT-capable), in
    huge pages where the kernel gives them (MADV_HUGEPAGE, as ckptfs's staging): the raw peers'
    best. An O_DIRECT transfer is cut into requests of at most max_segments pages; from 4 KiB
    pages that is ~1 MiB on a virtio disk, and this VM's disk then read at 1.3-1.8 GB/s where
    the same reads into huge pages ran at 3.4-3.7 GB/s: a floor measured from 4 KiB pages (as it
    was, in a shared mapping, which never gets huge pages) was no floor."""

    def __init__(self, nbytes: int, seed: int = 0):
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no THP here: 4 KiB pages
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 256, (min(nbytes, 8 * MiB),), dtype=torch.uint8, generator=g)
        view = torch.frombuffer(self.mm, dtype=torch.uint8)
        for off in range(0, nbytes, src.numel()):
            n = min(src.numel(), nbytes - off)
            view[off:off + n].copy_(src[:n])
        del view
        self.mv = memoryview(self.mm)

    def close(self) -> None:
        self.mv.release()
        self.mm.close()


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _split(total: int, block: int, threads: int) -> list[list[tuple[int, int]]]:
    """(offset, length) blocks, dealt out as contiguous ranges (one per thread)."""
    blocks = [(off, min(block, total - off)) for off in range(0, total, block)]
    per = (len(blocks) + threads - 1) // threads
    return [blocks[i * per:(i + 1) * per] for i in range(threads)]


def _run_threads(fn: Callable[[list[tuple[int, int]]], None], parts: list) -> None:
    if len(parts) == 1:
        fn(parts[0])
        return
    errs: list[BaseException] = []

    def wrap(p):
        try:
            fn(p)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(p,)) for p in parts if p]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]


def odirect_write(path: str, nbytes: int, buf: AlignedBuffer, threads: int = 1,
                  overwrite: bool = False) -> float:
    """Sequential O_DIRECT write of ``nbytes`` (rounded up to 4 KiB) from an aligned buffer in
    ``buf.nbytes`` blocks, then fdatasync. Returns seconds (open to sync). A new file (blocks
    allocated as it goes), or with ``overwrite`` in place over an existing file's blocks."""
    total = _round_up(nbytes)
    block = buf.nbytes
    flags = os.O_WRONLY | os.O_DIRECT | (0 if overwrite else os.O_CREAT | os.O_TRUNC)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        def work(blocks):
            for off, n in blocks:
                mv = buf.mv[:n]
                done = 0
                while done < n:
                    done += os.pwrite(fd, mv[done:], off + done)

        _run_threads(work, _split(total, block, threads))
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def odirect_write_states(path: str, nbytes: int, k: int, buf: AlignedBuffer) -> float:
    """``k`` states of ``nbytes`` overwritten in a row over an existing file's blocks (state i at
    i * nbytes rounded up to 4 KiB), each followed by fdatasync, as back-to-back saves into the
    slots of a ring make them durable. Returns seconds for all of them."""
    total = _round_up(nbytes)
    block = buf.nbytes
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        for i in range(k):
            for off, n in _split(total, block, 1)[0]:
                mv = buf.mv[:n]
                done = 0
                while done < n:
                    done += os.pwrite(fd, mv[done:], i * total + off + done)
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def odirect_read(path: str, nbytes: int, buf: AlignedBuffer, threads: int = 1, offset: int = 0) -> float:
    """Sequential O_DIRECT read of ``nbytes`` (rounded up to 4 KiB) of ``path`` from ``offset``
    (a multiple of 4 KiB)."""
    assert offset % 4096 == 0, offset
    total = _round_up(nbytes)
    block = buf.nbytes
    bufs = [buf] + [AlignedBuffer(block) for _ in range(threads - 1)]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        parts = _split(total, block, threads)

        def work(blocks, b):
            for off, n in blocks:
                mv = b.mv[:n]
                done = 0
                while done < n:
                    r = os.preadv(fd, [mv[done:]], offset + off + done)
                    if r <= 0:
                        raise IOError(f"short O_DIRECT read of {path} at {offset + off + done}")
                    done += r

        if threads == 1:
            work(parts[0], buf)
        else:
            _run_threads(lambda pb: work(*pb), [(p, b) for p, b in zip(parts, bufs) if p])
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    for b in bufs[1:]:
        b.close()
    return dt


def odirect_read_fresh(path: str, nbytes: int, block: int = 64 << 20) -> float:
    """Sequential O_DIRECT read of the first ``nbytes`` (rounded up to 4 KiB) of ``path`` into
    memory allocated for it (anonymous, freed after), on one thread: what a load that returns
    new tensors pays for their fresh pages (the kernel zeroes each one at its first touch), which
    ``odirect_read`` into one reused buffer does not. Returns seconds, the allocation included."""
    total = _round_up(nbytes)
    t0 = time.perf_counter()
    m = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's (torch.empty's) memory
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with memoryview(m) as mv:
            for off in range(0, total, block):
                n = min(block, total - off)
                done = 0
                while done < n:
                    r = os.preadv(fd, [mv[off + done:off + n]], off + done)
                    if r <= 0:
                        raise IOError(f"short O_DIRECT read of {path} at {off + done}")
                    done += r
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        m.close()


def buffered_write_fsync(path: str, nbytes: int, buf: AlignedBuffer) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off, n in _split(nbytes, buf.nbytes, 1)[0]:
            mv = buf.mv[:n]
            done = 0
            while done < n:
                done += os.pwrite(fd, mv[done:], off + done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def mmap_write_msync(path: str, nbytes: int, buf: AlignedBuffer) -> float:
    """ftruncate a new file, map it shared, copy the bytes in, msync (MS_SYNC) the mapping."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            src = torch.frombuffer(buf.mm, dtype=torch.uint8)
            for off, n in _split(nbytes, buf.nbytes, 1)[0]:
                dst[off:off + n].copy_(src[:n])
            del dst, src
            mm.flush()  # msync(MS_SYNC)
        finally:
            mm.close()
        os.fsync(fd)  # metadata (size, block allocation)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def buffered_read(path: str, nbytes: int, buf: AlignedBuffer) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < nbytes:
            r = f.readinto(buf.mv[:min(buf.nbytes, nbytes - done)])
            if not r:
                break
            done += r
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# stats / formatting


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds and seconds > 0 else float("nan")


def fmt_s(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def fmt_num(x: float | None, nd: int = 2) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{nd}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def ckptfs_status() -> tuple[bool, str]:
    """(usable, why-not): whether ``ckptfs.Store`` is importable and has the API the tools use."""
    try:
        import ckptfs  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"import ckptfs failed: {type(e).__name__}: {e}"
    store = getattr(ckptfs, "Store", None)
    if store is None:
        return False, "ckptfs.Store does not exist yet"
    missing = [m for m in ("create", "writer", "load") if not hasattr(store, m)]
    if missing:
        return False, f"ckptfs.Store lacks {', '.join(missing)}"
    return True, ""


def cannot_run(device: str) -> str | None:
    """Why a tool that saves through ckptfs cannot run here with its state on ``device`` (no
    CUDA, ckptfs not importable), in one line; None when it can."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda: CUDA is not available here"
    ok, why = ckptfs_status()
    return None if ok else f"ckptfs is not usable: {why}"


def writer_kwargs(max_inflight: int | None = None, persist_threads: int | None = None,
                  chunk_bytes: int | None = None, staging_budget_bytes: int | None = None) -> dict:
    """Only the writer options given on the command line (the library's defaults otherwise)."""
    kw = dict(max_inflight=max_inflight, persist_threads=persist_threads,
              chunk_bytes=chunk_bytes, staging_budget_bytes=staging_budget_bytes)
    return {k: v for k, v in kw.items() if v is not None}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return info


def fs_of(path: str) -> str:
    """'device on mountpoint type fstype' for the filesystem holding ``path``."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, f"{dev} on {mnt} type {typ}")
    except OSError:
        pass
    return best[1] or "?"


def write_json(path: str, results) -> None:
    """Write a tool's results as JSON (creating the folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"wrote {path}")
