"""Many ranks, one checkpoint: ckptfs as the storage of torch.distributed.checkpoint.

    import torch.distributed.checkpoint as dcp, ckptfs
    dcp.save(state_dict, storage_writer=ckptfs.dcp.StorageWriter(store, "gpt2", step=s))
    dcp.load(state_dict, storage_reader=ckptfs.dcp.StorageReader(store, "gpt2"))  # newest global step

DCP's planners shard, deduplicate and reshard; ckptfs stores each rank's part and commits the
global version once every part is durable (``ckptfs.dist.storage``; the load:
``ckptfs.dist.reader``). ``ckptfs.dcp`` is this package. Its names are imported on first use:
importing torch.distributed.checkpoint takes half a second, which a single-process user of the
package's light modules (``ckptfs.dist.names``, ``ckptfs.dist.parts``, ``ckptfs.dist.whole``:
the mount, the CLI) does not pay.
"""
from importlib import import_module

__all__ = ["StorageReader", "StorageWriter", "decode_metadata", "encode_metadata", "part_model"]
_HOMES = {"StorageReader": "reader", "StorageWriter": "storage", "decode_metadata": "codec",
          "encode_metadata": "codec", "part_model": "names"}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ckptfs.dist' has no attribute {name!r}")
    value = getattr(import_module(f"ckptfs.dist.{home}"), name)
    globals()[name] = value
    return value
