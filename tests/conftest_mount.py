"""Real kernel mounts for the tests (import what you need: ``from conftest_mount import ...``):
the helpers of :mod:`ckptfs.testing.mounts` (``mounted(region, mountpoint)`` and the rest),
``requires_fuse``, and a known region (``make_toy_region``) to mount."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import ckptfs
from ckptfs.testing.mounts import (CLI, Mount, force_unmount, fuse_available, mounted, start_mount,  # noqa: F401
                                   stop_mount)

requires_fuse = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse and fusermount3")


# ------------------------------------------------------------------------------ a known region

TOY_MODEL = "toy"
TOY_STEPS = (100, 200, 300)


def toy_state(step: int) -> dict:
    """A deterministic checkpoint per step: several dtypes, nested optimizer state with int keys,
    plain leaves, and a 1 MiB tensor so that reads span many FUSE requests."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": OrderedDict(
            weight=torch.randn(64, 32, generator=g),
            bias=torch.randn(64, generator=g).to(torch.bfloat16),
            big=torch.randn(256, 1024, generator=g),
            ids=torch.randint(0, 1000, (16, 8), generator=g),
        ),
        "optim": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(64, 32, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "step": step,
        "name": "toy",
        "flags": (True, None, 1.5),
    }


def make_toy_region(path: str, steps=TOY_STEPS, model: str = TOY_MODEL) -> None:
    """A region holding ``model`` at ``steps`` (``toy_state``), the last one latest."""
    with ckptfs.Store.create(path, size_bytes=256 << 20) as store:
        w = store.writer(model)
        try:
            for s in steps:
                w.save(toy_state(s), s).result()
            w.wait()
        finally:
            w.close()
