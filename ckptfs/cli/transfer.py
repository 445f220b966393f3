"""Versions in and out as files: ``export`` and ``import``."""
from __future__ import annotations

import os
import sys

import click

from ckptfs.cli.common import STEP, cli, open_store, progress, region_option, version_step, warn
from ckptfs.errors import CkptfsError
from ckptfs.units import human_bytes

EXPORT_BLOCK_BYTES = 8 << 20


@cli.command()
@region_option
@click.option("--step", type=STEP, help="The version: 1200 or step-00001200 (default: the latest).")
@click.option("--file", "file_name", metavar="NAME",
              help="Which file of the version: checkpoint.pt, state.safetensors, KEY.safetensors, metadata.json "
                   "(`ckptfs info MODEL` lists them).")
@click.option("--key", metavar="KEY", help="Export KEY.safetensors (the tensors under one top-level key).")
@click.option("--force", is_flag=True, help="Replace OUTPUT (or files in it) if it exists.")
@click.argument("model")
@click.argument("output", type=click.Path(allow_dash=True))
def export(region, step, file_name, key, force, model, output):
    """Write a version of MODEL to OUTPUT, as the mount shows it.

    \b
    OUTPUT a file: the file chosen by --file, else --key, else by OUTPUT's extension
      (.pt/.pth -> checkpoint.pt, .safetensors -> state.safetensors, .json -> metadata.json).
    OUTPUT a directory (one that exists, or a path ending in /): every file of the version
      (or the one chosen by --file / --key) in it, as `cp -r` of the version directory would.
    OUTPUT -: the chosen file to standard output.

    Every tensor is checked as it streams: a damaged version fails with the tensor's name and
    leaves no file behind (on standard output, the stream stops short). Existing files are
    replaced only with --force."""
    from ckptfs.dist.whole import as_whole, not_shown_words, version_files, whole_absent
    from ckptfs.views import files_for
    from ckptfs.views.safetensors import STATE_FILE, key_file_name

    if key is not None:
        if file_name is not None:
            raise click.UsageError("give --file or --key, not both")
        file_name = key_file_name(key)  # the mount's name of the key's file ('/' as '_')
        if file_name is None or file_name == STATE_FILE:
            raise click.UsageError(f"--key {key!r} has no file of its own"
                                   + (f" ({STATE_FILE} holds every tensor: --file {STATE_FILE})"
                                      if file_name else "") + "; `ckptfs info MODEL` lists the files")
    to_dir = output != "-" and (output.endswith(os.sep) or os.path.isdir(output))
    if output == "-" and file_name is None:
        raise click.UsageError("with OUTPUT -, choose the file with --file NAME or --key KEY")
    if not to_dir and file_name is None:
        file_name = _file_for_extension(output)
    parent = os.path.dirname(os.path.abspath(output.rstrip(os.sep) or os.sep))
    if output != "-" and not os.path.isdir(parent):
        raise CkptfsError(f"cannot write {output}: no directory {parent}")
    with open_store(region) as store:
        v, layout = as_whole(store, store.open_version(model, version_step(store, model, step).step, whole=False))
        with v:
            views = version_files(v, files_for)
            if file_name is not None and file_name not in views:
                why = whole_absent(v)
                raise CkptfsError(f"{model} step {v.info.step} has no {file_name}" + (
                    f" here ({why}: export it on a node that holds them all, or load it at the ranks)" if why
                    else f"; it has: {', '.join(views)}"))
            names = [file_name] if file_name is not None else list(views)
            targets = {n: os.path.join(output, n) if to_dir else output for n in names}
            if not force:
                for dest in targets.values():
                    if dest != "-" and os.path.lexists(dest):
                        raise CkptfsError(f"{dest} exists; add --force to replace it")
            written, done, made = 0, [], _dirs_to_make(targets.values())
            try:
                for name, dest in targets.items():
                    written += _export_file(views[name], v.data, dest)
                    done.append(dest)
            except BaseException:
                for dest in done:  # a version is exported whole or not at all; files it would
                    if dest != "-":  # replace (--force) are still there
                        os.unlink(dest + PART_SUFFIX)
                for d in sorted(made, key=len, reverse=True):  # and the directories made for it
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass  # not made after all, or holds something else now
                raise
            for dest in done:  # every file whole and checked: now they replace what was there
                if dest != "-":
                    os.replace(dest + PART_SUFFIX, dest)
        if layout and layout.not_shown:
            warn(f"{model} step {v.info.step}: left out {not_shown_words(layout.not_shown)}")
        if output != "-":
            what = file_name if file_name is not None else f"{len(names)} files"
            click.echo(f"exported {what} of {model} step {v.info.step} to {output} ({human_bytes(written)})")
        return 0


def _dirs_to_make(dests) -> set[str]:
    """The directories that writing ``dests`` makes (OUTPUT/ itself, a view's hf/): those to
    remove again if the export fails."""
    made = set()
    for dest in dests:
        if dest == "-":
            continue
        d = os.path.dirname(os.path.abspath(dest))
        while not os.path.isdir(d) and d not in made:
            made.add(d)
            d = os.path.dirname(d)
    return made


def _file_for_extension(output: str) -> str:
    """The version's file that an output name asks for by its extension (UsageError if none)."""
    ext = os.path.splitext(output)[1].lower()
    names = {".pt": "checkpoint.pt", ".pth": "checkpoint.pt", ".safetensors": "state.safetensors",
             ".json": "metadata.json"}
    if ext not in names:
        raise click.UsageError(f"cannot tell the format from {output!r}; choose it with --file NAME, "
                               "or give a directory to export every file")
    return names[ext]


PART_SUFFIX = ".ckptfs-part"  # an exported file while it is written, beside its place


def _export_file(view, data, dest: str) -> int:
    """Stream one view of a version to ``dest`` (``-``: standard output), checked as it goes;
    a file is written whole beside its place (``dest + PART_SUFFIX``), for the caller to rename
    once every file of the export is (nothing there is replaced before). Returns its size."""
    if dest == "-":
        out = sys.stdout.buffer  # (click.get_binary_stream is deprecated since Click 8.5)
        for block in view.iter_blocks(data.sequential_reader(), EXPORT_BLOCK_BYTES):
            out.write(block)
        out.flush()
        data.confirm()
        return view.size
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)  # views' subdirectories (hf/)
    tmp = dest + PART_SUFFIX
    try:
        with open(tmp, "wb") as f, progress(view.size, os.path.basename(dest)) as bar:
            # checked as it streams: a damaged tensor fails the export before the file is renamed
            for block in view.iter_blocks(data.sequential_reader(), EXPORT_BLOCK_BYTES):
                f.write(block)
                bar.update(len(block))
        data.confirm()  # the blocks were views of the mapping: none read a faulted page
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename in (tmp, None):  # a write's has none (a full disk)
            raise OSError(e.errno, e.strerror, dest) from None  # named as the user named it
        raise
    return view.size


@cli.command(name="import")
@region_option
@click.option("--step", type=STEP, help="Step of the new version (default: one past the latest, or 0).")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]),
              help="Default: from the extension, else from the first bytes.")
@click.option("--key", metavar="KEY", help="Store the tensors of a .safetensors under this top-level key.")
@click.argument("model")
@click.argument("file", type=click.Path())
def import_(region, step, fmt, key, model, file):
    """Import FILE (.safetensors, or a torch.save file) as a new version of MODEL.

    FILE may be a directory: a version directory of the mount or of `ckptfs export` (its whole
    object, state.safetensors or checkpoint.pt, and the extra files its metadata.json lists), or
    a Hugging Face model directory (save_pretrained's: model.safetensors, or its shards and their
    index; pytorch_model.bin too): its tensors become one version, its config.json is kept with
    it (the mount shows it as hf/, for from_pretrained), and a warning names the files left out
    (a Trainer's optimizer.pt: import it as a model of its own).

    The input is validated completely first; malformed or hostile input is refused with nothing
    written. Torch files are read with torch.load(weights_only=True)."""
    from ckptfs.importer import import_file

    with open_store(region, create=True) as store:
        v = import_file(store, model, file, step=step, fmt=fmt, key=key)
        click.echo(f"imported {file} as {model} step {v.step} ({human_bytes(v.data_bytes)})")
        return 0
