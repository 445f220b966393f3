"""The registry of views: which files (and subdirectories) each view contributes to a version.

A view is one module that builds ``View`` objects from a manifest and registers, once, a function
``manifest -> {path: View}``. A path may hold '/' (``hf/config.json``): the mount shows it as a
subdirectory of the version. The mount, ``ckptfs export``, ``ckptfs info`` and the mount option
``-o views=`` all list from here, so a new format is one new module and one ``register`` call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ckptfs.gcpause import paused_gc
from ckptfs.manifest import Manifest
from ckptfs.views.segments import View

FilesOf = Callable[[Manifest], "dict[str, View]"]


@dataclass(frozen=True)
class ViewSpec:
    """A registered view: its id (as ``-o views=`` names it), what it is, and its files."""

    view_id: str
    summary: str
    files_of: FilesOf


_VIEWS: dict[str, ViewSpec] = {}


def register(view_id: str, files_of: FilesOf, *, summary: str) -> Callable[[], None]:
    """Add a view after those registered so far (listing order = registration order; on a path
    two views both give, the first wins). Returns a function that removes it again."""
    if not view_id or not view_id.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"view id {view_id!r} must be letters, digits, '-' or '_'")
    if view_id in _VIEWS:
        raise ValueError(f"a view {view_id!r} is already registered")
    spec = ViewSpec(view_id, summary, files_of)
    _VIEWS[view_id] = spec

    def unregister() -> None:
        if _VIEWS.get(view_id) is spec:
            del _VIEWS[view_id]

    return unregister


def registered_views() -> list[ViewSpec]:
    """Every registered view, in listing order."""
    return list(_VIEWS.values())


def check_view_ids(view_ids: Iterable[str]) -> tuple[str, ...]:
    """``view_ids`` as a tuple; ValueError naming the unknown ones and the known ones."""
    ids = tuple(view_ids)
    unknown = [v for v in ids if v not in _VIEWS]
    if unknown:
        raise ValueError(f"unknown view(s) {', '.join(unknown)}; the views are: {', '.join(_VIEWS)}")
    return ids


def files_for(manifest: Manifest, views: Iterable[str] | None = None) -> dict[str, View]:
    """Every file of a version directory, by path, in listing order: the files of each selected
    view (``views``: ids; None: all), in registration order. A path that another view already
    gave, or that clashes with one (a file where a directory is, or the reverse), is left out."""
    selected = registered_views() if views is None else [_VIEWS[v] for v in check_view_ids(views)]
    files: dict[str, View] = {}
    directories: set[str] = set()
    with paused_gc():
        contributed = [spec.files_of(manifest) for spec in selected]
    for of_view in contributed:
        for path, view in of_view.items():
            parents = _parents(path)
            if path in files or path in directories or any(p in files for p in parents):
                continue
            files[path] = view
            directories.update(parents)
    return files


def _parents(path: str) -> list[str]:
    """``a/b/c`` -> ``["a", "a/b"]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
