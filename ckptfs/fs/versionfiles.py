"""The files of each listed version of a mount, made once per version and kept while it is
listed (ckptfs.fs.tree's contract **Files**). No FUSE calls in here.

A version is keyed by ``(model, step, save_id)``: a step committed again is another version,
with other files. Per version, this keeps its views (``{path: View}``), its decoded index (each
later open reuses it), the tensors and blocks found intact (a version is checksummed once per
mount: its bytes cannot change while it is committed) and, for a multi-rank version, the layout
of its whole tensors (ckptfs.dist.whole).
"""
from __future__ import annotations

import errno
from typing import Any, Callable

from ckptfs.fs.names import version_dirname
from ckptfs.gcpause import paused_gc

Key = tuple  # (model, step, save_id)


class VersionFiles:
    """The per-version caches of one mount over ``store``. ``files_for(manifest) -> {path: View}``
    gives a version's files; ``as_whole(store, version, layout)`` reads a pinned version (a
    multi-rank one as its whole tensors); ``replaced()`` is called when a version turns out to
    be gone since the listing that named it (the tree then lists again)."""

    def __init__(self, store, files_for: Callable, as_whole: Callable, replaced: Callable[[], None]):
        self._store = store
        self._files_for = files_for
        self._as_whole = as_whole
        self._replaced = replaced
        self._views: dict[Key, dict[str, Any]] = {}  # -> its files
        self._checked: dict[Key, set] = {}  # -> tensors (and blocks) found intact
        self._manifests: dict[Key, Any] = {}  # -> its decoded index
        self._layouts: dict[Key, Any] = {}  # -> WholeLayout, or False: not multi-rank

    def __contains__(self, key: Key) -> bool:
        """Whether the files of version ``key`` are made (and kept)."""
        return key in self._views

    def views(self, key: Key, info, version=None) -> dict[str, Any]:
        """{path: View} of the listed version ``key`` (``info``: its VersionInfo), made from its
        index on first use: through ``version`` if the caller holds it pinned, else under a short
        pin of its own (HeldError at once while its commit holds it: the caller waits,
        ``ops._unheld``). ENOENT if its slot was reused since the listing."""
        views = self._views.get(key)
        if views is not None:
            return views
        # one pause of the cyclic GC over the index's decoding and the views' synthesis:
        # between the two, a collection would traverse every record just made
        with paused_gc():
            if version is not None:
                views = self._made(version, info)
            else:
                model, step, _ = key
                with self._whole(key, self._store.open_version(model, step, counter=info.counter,
                                                               wait_s=0.0, whole=False)) as pinned:
                    views = self._made(pinned, info)
                    version = pinned
        self._views[key] = views
        self._manifests[key] = getattr(version, "version", version).manifest
        return views

    def open(self, key: Key):
        """The version ``key`` opened and pinned for reads of its files, with the mount's set of
        what was found intact and its index when decoded before (Store.open_version, without
        waiting); a multi-rank version as its whole tensors."""
        model, step, _ = key
        checked = self._checked.setdefault(key, set())
        return self._whole(key, self._store.open_version(model, step, checked=checked,
                                                         manifest=self._manifests.get(key), wait_s=0.0,
                                                         whole=False))

    def forget(self, live: set, which: Callable[[Key], bool]) -> None:
        """Let go of everything kept of the versions not in ``live`` for which ``which`` holds."""
        for key in (self._views.keys() | self._checked.keys() | self._manifests.keys() | self._layouts.keys()) - live:
            if which(key):
                self._views.pop(key, None)
                self._checked.pop(key, None)
                self._manifests.pop(key, None)
                self._layouts.pop(key, None)

    def _whole(self, key: Key, version):
        """``version`` itself, or, for a multi-rank DCP version, the pinned whole-tensor reading
        of it (ckptfs.dist.whole: its files show whole, unsharded tensors), whose layout is made
        once per listed version. ``version`` is closed if that fails."""
        opened, self._layouts[key] = self._as_whole(self._store, version, self._layouts.get(key))
        return opened

    def _made(self, version, info) -> dict[str, Any]:
        if version.info.save_id != info.save_id:  # the slot was reused since the listing
            self._replaced()
            raise FileNotFoundError(errno.ENOENT, f"{info.model} {version_dirname(info.step)} was replaced")
        from ckptfs.dist.whole import version_files

        return version_files(version, self._files_for)
