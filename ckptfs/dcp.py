"""``ckptfs.dcp``: ckptfs as the storage of torch.distributed.checkpoint (the package
``ckptfs.dist``, under the name DCP users look for): ``StorageWriter``, ``StorageReader``."""
from ckptfs.dist import StorageReader, StorageWriter, decode_metadata, encode_metadata, part_model

__all__ = ["StorageReader", "StorageWriter", "decode_metadata", "encode_metadata", "part_model"]
