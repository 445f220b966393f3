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
