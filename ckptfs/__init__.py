"""ckptfs: a checkpoint store for ML training.

    store = ckptfs.Store()                       # the default region
    with store.writer("gpt2", max_inflight=2) as w:
        w.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=120)
    state = store.load("gpt2")                   # newest committed checkpoint
"""
from ckptfs import errors
from ckptfs.region.upgrade import upgrade
from ckptfs.store import Store, Version, VersionInfo, default_region_path

__all__ = ["Store", "Writer", "Version", "VersionInfo", "SaveResult", "VerifyProblem",
           "default_region_path", "errors", "upgrade"]
__version__ = "0.1.0"


_LAZY = {"Writer": "ckptfs.writer.writer", "SaveResult": "ckptfs.writer.writer", "VerifyProblem": "ckptfs.reader"}


def __getattr__(name: str):
    """The names that need torch, imported on first use: listing a region (`ckptfs ls`, `status`)
    needs no torch, whose import is most of such a command's second. ``ckptfs.dcp``: the
    torch.distributed.checkpoint storage (ckptfs.dist; torch.distributed.checkpoint is slow to
    import)."""
    if name == "dcp":
        import ckptfs.dcp as dcp

        return dcp
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptfs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"dcp"})  # tab completion finds the lazy names too
