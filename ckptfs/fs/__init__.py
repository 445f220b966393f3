"""The FUSE filesystem: a read-only (but for ``rm -r`` of a version) view of a region.

* :mod:`ckptfs.fs.tree`   -- the name space and inode table, built from Store listings and views;
* :mod:`ckptfs.fs.ops`    -- the pyfuse3 handlers, a thin layer over the tree;
* :mod:`ckptfs.fs.errors` -- ``errno_for(exc)``, the one place exceptions become errno values;
* :mod:`ckptfs.fs.daemon` -- mounting, background start with a ready handshake, unmounting.

Nothing is imported here: the CLI takes the daemon's settings and the tree's step names without
loading pyfuse3 and trio (a tenth of a second of every command).
"""
