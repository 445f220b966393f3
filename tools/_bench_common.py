"""Shared helpers of the benchmark tools (``bench_save.py``, ``train_emulator.py``).

Nothing here belongs to the library: these are the states the tools checkpoint and small timing /
formatting helpers (the raw-I/O baselines are in ``_raw_io.py``).
GB means 10**9 bytes everywhere (GB/s as in DESIGN.md); GiB/MiB are used for sizes given on the
command line.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections import OrderedDict
from typing import Any, Iterable

import torch

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30


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
