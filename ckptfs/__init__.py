"""ckptfs: a checkpoint store for ML training.

    store = ckptfs.Store()                       # the default region
    with store.writer("gpt2", max_inflight=2) as w:
        w.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=120)
    state = store.load("gpt2")                   # newest committed checkpoint
"""
from ckptfs import errors
from ckptfs.reader import VerifyProblem
from ckptfs.region.upgrade import upgrade
from ckptfs.store import Store, Version, VersionInfo, default_region_path
from ckptfs.writer.writer import SaveResult, Writer

__all__ = ["Store", "Writer", "Version", "VersionInfo", "SaveResult", "VerifyProblem",
           "default_region_path", "errors", "upgrade"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``ckptfs.dcp``: the torch.distributed.checkpoint storage (ckptfs.dist), imported on first
    use (torch.distributed.checkpoint is slow to import)."""
    if name == "dcp":
        import ckptfs.dcp as dcp

        return dcp
    raise AttributeError(f"module 'ckptfs' has no attribute {name!r}")
