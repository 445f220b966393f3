"""Test harnesses for ckptfs's reliability claims (issue 4, docs/PERSISTENCE.md).

* :mod:`ckptfs.testing.recording` -- an instrumented file backend that records every write, every
  barrier and every persisted update of the mapped metadata, in one total order;
* :mod:`ckptfs.testing.crashsim` -- lost-write crash emulation: from such a recording, build the
  region images a crash could leave behind and check the invariants on each with the real code.

Nothing here is imported by ckptfs itself; it needs numpy and torch like the rest of ckptfs.
"""
