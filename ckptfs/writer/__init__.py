"""The writer: plan, snapshot and persist phases of a save; it commits through ckptfs.region.ring
and never touches the on-disk format itself."""
