"""Many ranks, one checkpoint: ckptfs as the storage of torch.distributed.checkpoint.

    import torch.distributed.checkpoint as dcp, ckptfs
    dcp.save(state_dict, storage_writer=ckptfs.dcp.StorageWriter(store, "gpt2", step=s))
    dcp.load(state_dict, storage_reader=ckptfs.dcp.StorageReader(store, "gpt2"))  # newest global step

DCP's planners shard, deduplicate and reshard; ckptfs stores each rank's part and commits the
global version once every part is durable (``ckptfs.dist.storage``). ``ckptfs.dcp`` is this
package.
"""
from ckptfs.dist.codec import decode_metadata, encode_metadata
from ckptfs.dist.storage import StorageReader, StorageWriter, part_model

__all__ = ["StorageReader", "StorageWriter", "decode_metadata", "encode_metadata", "part_model"]
