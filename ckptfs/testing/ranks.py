"""Multi-process gloo groups for the tests of ckptfs.dist: a real torch.distributed job on
localhost (one process per rank, CPU, gloo), FSDP2 (``fully_shard``) over a small model with
AdamW, saved and loaded through DCP with ckptfs as its storage."""
from __future__ import annotations

import faulthandler
import os
import socket
import traceback
from datetime import timedelta

import torch

from ckptfs.testing.load import mp_context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout_s: float = 110, may_die: frozenset = frozenset(),
              backend: str = "gloo") -> list[int]:
    """Run ``target(rank, world, *args)`` in ``world`` processes joined in one process group of
    ``backend`` (gloo; ``"cpu:gloo,cuda:nccl"`` for a GPU job, each rank on the GPU of its
    number); AssertionError with each failing rank's traceback. Ranks in ``may_die`` may be
    killed (a crash test's victims); returns every rank's exit code. A rank still running after
    ``timeout_s`` is killed; 10 s before, it prints where each of its threads is and ends."""
    ctx = mp_context()
    port = free_port()
    errors = ctx.Queue()
    hang_s = max(1.0, timeout_s - 10)
    procs = [ctx.Process(target=_rank_main, args=(target, rank, world, port, errors, args, backend, hang_s))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if stuck:
        failures.append(f"{len(stuck)} rank(s) still running after {timeout_s} s")
    failures += [f"rank {i} exited with {p.exitcode}" for i, p in enumerate(procs)
                 if p.exitcode and i not in may_die and not failures]
    assert not failures, "\n".join(failures)
    return [p.exitcode for p in procs]


def _rank_main(target, rank, world, port, errors, args, backend, hang_s) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.dump_traceback_later(hang_s, exit=True)  # a rank that hangs says where, and ends
    try:
        if "cuda" in backend:
            torch.cuda.set_device(rank)  # one GPU per rank, as torchrun's LOCAL_RANK
        # a collective waiting for a dead rank gives up after a minute, not gloo's half hour
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        try:
            target(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def toy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def sharded(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """``model`` under FSDP2 over a CPU mesh of ``world`` ranks (each Linear a unit of its own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_steps(model: torch.nn.Module, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=g)).sum().backward()
        opt.step()


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A small transformer: GPT-2 of 2 blocks, built from a config (transformers; no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    return GPT2LMHeadModel(config)


def sharded_gpt2(world: int, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """``tiny_gpt2`` on ``device`` (cpu, or cuda: each rank its current GPU) under FSDP2 over a
    mesh of ``world`` ranks: each block a unit of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt2(seed).to(device)
    mesh = init_device_mesh(device, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_gpt2(model: torch.nn.Module, opt, steps: int, seed: int, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        ids = torch.randint(0, 96, (2, 16), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
