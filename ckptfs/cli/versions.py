"""The versions of a model: ``ls``, ``info``, ``verify``, ``rm``, ``keep``, ``unkeep``."""
from __future__ import annotations

import json

import click

from ckptfs.cli.common import (STEP, cli, info_dict, json_option, open_store, part_models, progress,
                               region_option, shown, table, version_step, when)
from ckptfs.dist.parts import loadable
from ckptfs.errors import HeldError, NotFoundError
from ckptfs.units import human_bytes


@cli.command(name="ls")
@region_option
@json_option
@click.option("-a", "--all", "show_all", is_flag=True,
              help="Also the models whose name starts with '.' (each rank's parts of a DCP checkpoint).")
@click.argument("model", required=False)
def ls_(region, as_json, show_all, model):
    """List the models, or the committed versions of MODEL."""
    with open_store(region) as store:
        if model is None:
            rows = []
            names = store.models()
            for name in names:
                if name.startswith(".") and not show_all:
                    continue  # hidden, as in the mount: ranks' parts (.MODEL.rankN)
                versions = store.versions(name, missing_ok=True)  # [] if removed since the listing
                if not versions and name not in store.models():
                    continue
                versions = loadable(store, name, versions, names)
                latest = next((v for v in versions if v.latest), None)
                rows.append({"model": name, "versions": len(versions),
                             "latest_step": latest.step if latest else None,
                             "latest_bytes": latest.data_bytes if latest else 0,
                             "size": (_size(store, latest) if latest else None) or "-"})
            if as_json:
                click.echo(json.dumps([{k: v for k, v in r.items() if k != "size"} for r in rows], indent=1))
            else:
                table([[r["model"], r["versions"], "-" if r["latest_step"] is None else r["latest_step"], r["size"]]
                        for r in rows], ["MODEL", "VERSIONS", "LATEST", "SIZE"])
            return 0
        versions = loadable(store, model, store.versions(model))
        if as_json:
            click.echo(json.dumps([info_dict(v) for v in versions], indent=1))
        else:
            sized = [(v, _size(store, v)) for v in versions]
            damaged = store.damaged_indexes(versions)
            table([[v.step, ", ".join(m for m, on in (("latest", v.latest), ("kept", v.kept),
                                                      ("damaged", v.counter in damaged)) if on),
                     when(v.time_ns), size, v.counter] for v, size in sized if size is not None],
                  ["STEP", "", "TIME", "SIZE", "COUNTER"])
        return 0


def _size(store, v) -> str | None:
    """A version's size as ls shows it; for a DCP checkpoint (no tensors of its own) the bytes of
    its ranks' parts, and how many ranks. None where it went since it was listed (a job saving
    meanwhile: the ring reused its slot)."""
    if v.data_bytes == 0:
        from ckptfs.dist.parts import checkpoint_bytes

        try:
            parts = checkpoint_bytes(store, v.model, v.step)
        except (NotFoundError, HeldError):  # gone, or going (its slot claimed by a save)
            return None
        if parts is not None:
            nbytes, ranks, elsewhere = parts
            return (f"{human_bytes(nbytes)} in {ranks} rank(s)"
                    + (f" ({elsewhere} on other nodes)" if elsewhere else ""))
    return human_bytes(v.data_bytes)


@cli.command()
@region_option
@json_option
@click.option("--step", type=STEP, help="The version: 1200 or step-00001200 (default: the latest).")
@click.argument("model")
def info(region, as_json, step, model):
    """Show one version of MODEL: step, time, tensors (dtype, shape, size, CRC32), files."""
    from ckptfs.dist.whole import as_whole, not_shown_words, version_files, whole_absent
    from ckptfs.views import files_for

    with open_store(region) as store:
        v, layout = as_whole(store, store.open_version(model, version_step(store, model, step).step, whole=False))
        with v:
            m = v.manifest  # a multi-rank version's whole tensors
            files = {name: view.size for name, view in version_files(v, files_for).items()}
            # a multi-rank version's data: its tensors' bytes, as ls counts them (its manifest's
            # data_bytes spans the address space the whole tensors are laid out in, parts beside)
            data_bytes = sum(t.nbytes for t in m.tensors) if layout else m.data_bytes
            doc = dict(info_dict(v.info), data_bytes=data_bytes, files=files, whole_absent=whole_absent(v),
                       not_shown=list(layout.not_shown) if layout else [], tensors=[
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
                 "crc32": f"{t.crc32:08x}"} for t in m.tensors])
        if as_json:
            click.echo(json.dumps(doc, indent=1))
            return 0
        click.echo(f"model    {doc['model']}")
        click.echo(f"step     {doc['step']}{' (latest)' if doc['latest'] else ''}")
        click.echo(f"time     {when(doc['time_ns'])}")
        click.echo(f"counter  {doc['counter']}  slot {doc['slot']}")
        click.echo(f"data     {human_bytes(doc['data_bytes'])} in {len(doc['tensors'])} tensors")
        if doc.get("whole_absent"):
            click.echo(f"whole    not shown here: {doc['whole_absent']}")
        if doc["not_shown"]:
            click.echo(f"left out {shown(not_shown_words(doc['not_shown']))}")
        click.echo("files    " + ", ".join(f"{shown(n)} ({human_bytes(s)})" for n, s in files.items()))
        click.echo()
        table([[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", human_bytes(t["nbytes"]), t["crc32"]]
                for t in doc["tensors"]], ["TENSOR", "DTYPE", "SHAPE", "SIZE", "CRC32"])
        return 0


@cli.command()
@region_option
@click.option("--step", type=STEP, help="Only this version: 1200 or step-00001200 (needs MODEL).")
@click.argument("model", required=False)
def verify(region, step, model):
    """Check the CRC32 of every tensor of a version, of a model, or of the whole region.

    Exits 1 and prints one line per problem on a mismatch."""
    if step is not None and model is None:
        raise click.UsageError("--step needs a MODEL")
    with open_store(region) as store:
        # a multi-rank model's versions hold its ranks' parts: those are checked with it
        names = [model, *part_models(store, model)] if model else store.models()
        total = sum(v.data_bytes for name in names for v in store.versions(name, missing_ok=model is None)
                    if step is None or v.step == step)
        with progress(total, "verify") as bar:
            problems = store.verify(model, step, progress=bar.update)  # called with bytes just checked
        for p in problems:
            click.echo(f"ckptfs: verify: {p}", err=True)
        what = f"{model} step {step}" if step is not None else (model or "the region")
        if problems:
            click.echo(f"ckptfs: {len(problems)} problem(s) in {what}", err=True)
            return 1
        click.echo(f"ok: {what} verified")
        return 0


@cli.command()
@region_option
@click.option("--all", "all_", is_flag=True,
              help="Remove MODEL itself with every version (a multi-rank model with its ranks' parts).")
@click.option("--step", "step_options", type=STEP, multiple=True,
              help="A version to remove (repeatable; the same as a STEPS argument).")
@click.option("--allow-latest", is_flag=True,
              help="Remove the latest version too, rolling MODEL back: its latest becomes the newest version "
                   "left (a job resumed from it saves the later steps again).")
@click.argument("model")
@click.argument("steps", nargs=-1, type=STEP)
def rm(region, all_, step_options, allow_latest, model, steps):
    """Remove versions STEPS of MODEL (1200 or step-00001200; not while pinned; the latest only
    with --allow-latest), or the model with --all."""
    steps = tuple(step_options) + tuple(steps)
    if all_ == bool(steps):
        raise click.UsageError("give the STEPS to remove, or --all (and no steps) to remove the whole model")
    with open_store(region) as store:
        if all_:
            store.remove_model(model)
            click.echo(f"removed {model}")
        _check_present(store, model, steps)
        removed = False
        try:
            for s in _removal_order(store, model, steps, allow_latest):
                store.remove(model, s, allow_latest=allow_latest, give_back=False)
                removed = True
                click.echo(f"removed {model} step {s}")
        finally:  # once, and for those removed before a refusal too
            if removed:
                store.give_back_emptied(model)
        if allow_latest and steps:
            latest = store.latest(model, missing_ok=True)
            click.echo(f"latest of {model}: " + (f"step {latest.step}" if latest is not None else "none"))
        return 0


def _removal_order(store, model: str, steps, allow_latest: bool) -> list[int]:
    """The steps in the order they are removed: the latest last, so that it moves back once, to
    the newest version left (not to one about to go, whose parts may be gone); without
    --allow-latest first, so that its refusal comes before anything is removed."""
    order = sorted(set(steps))
    latest = store.latest(model, missing_ok=True)
    if latest is not None and latest.step in order:
        order.remove(latest.step)
        order = order + [latest.step] if allow_latest else [latest.step] + order
    return order


@cli.command()
@region_option
@click.argument("model")
@click.argument("steps", nargs=-1, type=STEP, required=True)
def keep(region, model, steps):
    """Keep versions STEPS of MODEL (milestones): the ring never reuses them until `ckptfs unkeep`
    or `ckptfs rm`; each takes its slot out of the ring, which takes another from free space."""
    return _set_kept(region, model, steps, True)


@cli.command()
@region_option
@click.argument("model")
@click.argument("steps", nargs=-1, type=STEP, required=True)
def unkeep(region, model, steps):
    """Give kept versions STEPS of MODEL back to the ring (reused once older than what it keeps)."""
    return _set_kept(region, model, steps, False)


def _check_present(store, model: str, steps) -> None:
    """NotFoundError for the first of ``steps`` that ``model`` lacks, before any is changed (a
    mistyped step among several removed the others, a milestone among them)."""
    for s in steps:
        version_step(store, model, s)


def _set_kept(region, model: str, steps, kept: bool) -> int:
    with open_store(region) as store:
        _check_present(store, model, steps)
        for s in steps:
            changed = (store.keep if kept else store.unkeep)(model, s)
            if changed:
                click.echo(f"{'kept' if kept else 'unkept'} {model} step {s}")
            else:
                click.echo(f"{model} step {s} was {'kept already' if kept else 'not kept'}")
    return 0
