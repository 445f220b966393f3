"""The ``ckptfs`` command.

Every command takes ``--region PATH``, after the command or before it (``ckptfs --region R ls``;
default: ``$CKPTFS_REGION``, else the per-user default region). Errors are one line on stderr and a non-zero exit status (1 for an error, 2 for a usage
error, 130 when interrupted); a traceback is printed only with ``CKPTFS_DEBUG=1``.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys
from typing import Any

import click

from ckptfs.errors import CkptfsError, cli_words
from ckptfs.fs.daemon import READAHEAD_KB
from ckptfs.units import human_bytes

EXPORT_BLOCK_BYTES = 8 << 20


# ------------------------------------------------------------------------------ helpers


def _region_option(f):
    return click.option(
        "--region", "region", metavar="PATH", callback=_region_given,
        help="The region (file, block device or /dev/daxX.Y). Default: the per-user default region. "
             "[env var: CKPTFS_REGION]",
    )(f)


def _region_given(ctx: click.Context, param: click.Parameter, value):
    """A command's region: its own --region, else the one before the command (``ckptfs --region
    R ls``), else None: the default region, which is $CKPTFS_REGION where set (ckptfs.store).
    Not click's envvar, which would put the environment before the --region given first."""
    return value if value is not None else ctx.find_root().params.get("region")


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def _part_models(store, model: str) -> list[str]:
    from ckptfs.dist.names import part_models

    return part_models(store, model)


def _open_store(region: str | None, *, create: bool = False):
    """The region of --region (default: the per-user one). Only commands that write (mount,
    import) may create the default region; the others say that there is none yet."""
    from ckptfs import Store

    return Store(region, create=create)


class _Command(click.Command):
    """A command whose "not found" or "bad name" error says instead which of its arguments is a
    region, where one is: ``ckptfs ls r.region`` looked for a model of that name."""

    def invoke(self, ctx):
        from ckptfs.errors import InvalidNameError, NotFoundError

        try:
            return super().invoke(ctx)
        except (NotFoundError, InvalidNameError) as e:
            given = _region_among(ctx.params)
            if given is None:
                raise
            raise type(e)(f"{given} is a region, not a model: pass it as --region {given} "
                          "(or set CKPTFS_REGION)") from None


class _Group(click.Group):
    command_class = _Command


def _region_among(params: dict) -> str | None:
    """The first of a command's arguments (not --region) that names a ckptfs region."""
    from ckptfs.region.mkfs import is_region_file

    return next((value for name, value in params.items()
                 if name != "region" and isinstance(value, str) and is_region_file(value)), None)


class _Step(click.ParamType):
    """A step as users write it: ``1200`` or a version directory's name ``step-00001200``."""

    name = "STEP"

    def convert(self, value, param, ctx):
        from ckptfs.fs.names import step_of

        step = value if isinstance(value, int) else step_of(str(value).strip())
        if step is None:
            self.fail(f"{value!r} is not a step (e.g. 1200 or step-00001200)", param, ctx)
        return step


STEP = _Step()


def _parse_size(text: str) -> int:
    """'64G', '512MiB', '1.5T', '4096' -> bytes (binary multiples)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 64G, 512M, 4096)")
    scale = 1024 ** "bkmgtp".index((m.group(2) or "b").lower())
    return int(float(m.group(1)) * scale)


def _when(time_ns: int) -> str:
    return datetime.datetime.fromtimestamp(time_ns / 1e9).isoformat(sep=" ", timespec="seconds")


def _table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    # one write: an echo per row was a third of `info` of a version of 40,000 tensors
    click.echo("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells))


def _info_dict(v) -> dict:
    return {"model": v.model, "step": v.step, "counter": v.counter, "slot": v.slot,
            "time_ns": v.time_ns, "data_bytes": v.data_bytes, "latest": bool(v.latest), "kept": bool(v.kept)}


def _progress(total: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False)


def _version_step(store, model: str, step: int | None):
    """The VersionInfo of ``step`` (None: the latest) or NotFoundError."""
    from ckptfs.errors import no_step, no_version_yet

    if step is None:
        latest = store.latest(model)
        if latest is None:
            raise no_version_yet(model)
        return latest
    for v in store.versions(model):
        if v.step == step:
            return v
    raise no_step(model, step)


# ------------------------------------------------------------------------------ the commands


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ckptfs", prog_name="ckptfs")
@click.option("--region", "region", metavar="PATH",
              help="The region of the command that follows, as if given to it (its own --region wins).")
def cli(region):
    """ckptfs: a checkpoint store for ML training, browsable as files.

    \b
    Quick look:   ckptfs ls; ckptfs mount /ckpt; ls /ckpt/<model>/latest/
    Errors: one line on stderr, non-zero exit; CKPTFS_DEBUG=1 shows tracebacks.
    """


@cli.command()
@_region_option
@click.option("--size", "size", metavar="SIZE",
              help="Size of a file region, e.g. 64G (default 64G, sparse). A device region takes the whole device.")
@click.option("--exist-ok", is_flag=True, help="Succeed without change if a region is already there.")
@click.option("--force", is_flag=True,
              help="Overwrite whatever is there: a region (every checkpoint in it), a file, a device holding data.")
@click.argument("path", required=False, metavar="[REGION]")
def mkfs(region, size, exist_ok, force, path):
    """Format a new region (a sparse file, a block device or a devdax device).

    REGION (or --region) defaults to the per-user default region. Refuses to overwrite an
    existing region, a non-empty file or a device holding data unless --force."""
    from ckptfs import Store, default_region_path

    if path is not None and region is not None and path != region:
        raise click.UsageError("give the region once: REGION or --region")
    region = path or region or default_region_path()

    if force and exist_ok:
        raise click.UsageError("--force and --exist-ok contradict each other: give one")
    kwargs: dict[str, Any] = {"exist_ok": exist_ok, "force": force}
    if size is not None:
        kwargs["size_bytes"] = _parse_size(size)
    with Store.create(region, **kwargs) as store:
        click.echo(f"region {store.path} ready")


@cli.command()
@_region_option
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground (for debugging and services).")
@click.option("--allow-other", is_flag=True, help="Let other users read the mount (root, or user_allow_other).")
@click.option("-o", "options", multiple=True, metavar="OPT[,OPT...]",
              help="Mount options: views=ID[:ID...] shows only those views' files (ids: see below); "
                   "anything else goes to libfuse.")
@click.option("--auto-unmount/--no-auto-unmount", default=True, show_default=True,
              help="Have fusermount3 unmount if the daemon dies.")
@click.option("--readahead-kb", type=click.IntRange(0), default=READAHEAD_KB, show_default=True,
              help="Kernel readahead of the mount (root only; 0: leave FUSE's 128 KiB).")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Where the daemon logs (default: stderr).")
@click.option("--debug", is_flag=True, help="Verbose log: pyfuse3 internals and every error answered to the kernel.")
@click.option("--ready-fd", type=int, hidden=True)
@click.argument("mountpoint", type=click.Path(file_okay=False))
def mount(region, foreground, allow_other, options, auto_unmount, readahead_kb, log_file, debug, ready_fd,
          mountpoint):
    """Mount the region at MOUNTPOINT: /MODEL/latest, /MODEL/step-NNNNNNNN/{checkpoint.pt, ...}.

    Returns once the mount is up; the daemon keeps serving in the background (--foreground to
    stay attached). Unmount with `ckptfs umount MOUNTPOINT`, or SIGTERM/SIGINT to the daemon.

    Views (-o views=torch:metadata; ':' or '+' between ids): torch (checkpoint.pt), safetensors
    (state.safetensors, KEY.safetensors), metadata (metadata.json); default: all.
    """
    from ckptfs.fs import daemon

    mountpoint = os.path.abspath(mountpoint)
    extra = [o.strip() for opt in options for o in opt.split(",")]
    views = _views_option(extra)
    if not foreground:
        daemon.check_mountpoint(mountpoint)
        store = _open_store(region, create=True)  # report a bad region here, from the caller
        path = os.path.abspath(store.path)  # the daemon runs in /
        store.close()
        argv = daemon.foreground_argv() + ["mount", "--foreground", "--region", path, mountpoint]
        argv += ["--allow-other"] * allow_other + [f"-o{o}" for o in extra]
        argv += [] if auto_unmount else ["--no-auto-unmount"]
        argv += ["--readahead-kb", str(readahead_kb)]
        argv += ["--log-file", os.path.abspath(log_file)] if log_file else []
        argv += ["--debug"] if debug else []
        daemon.spawn_background(argv)
        return 0

    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s ckptfs[%(process)d] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    if ready_fd is not None:
        os.chdir("/")
    try:
        store = _open_store(region, create=True)
    except CkptfsError as exc:
        daemon.report_failure(ready_fd, str(exc))
        raise
    try:
        daemon.serve(store, mountpoint, allow_other=allow_other, auto_unmount=auto_unmount,
                     extra_options=[o for o in extra if not o.startswith("views=")], views=views,
                     readahead_kb=readahead_kb,
                     on_ready=daemon.ready_signaller(ready_fd))
    except (CkptfsError, daemon.MountError, OSError) as exc:
        daemon.report_failure(ready_fd, _one_line(exc))
        raise
    finally:
        store.close()
    return 0


def _views_option(options: list[str]) -> tuple[str, ...] | None:
    """The view ids of ``-o views=ID[:ID...]`` (the last one given), or None; UsageError for an
    unknown id."""
    from ckptfs.views import check_view_ids

    given = [o[len("views="):] for o in options if o.startswith("views=")]
    if not given:
        return None
    ids = tuple(v for v in given[-1].replace("+", ":").split(":") if v)
    if not ids:
        raise click.UsageError("-o views= needs at least one view id, e.g. -o views=torch:metadata")
    try:
        return check_view_ids(ids)
    except ValueError as e:
        raise click.UsageError(f"-o views={given[-1]}: {e}") from None


@cli.command()
@_region_option
@click.argument("mountpoint", type=click.Path(file_okay=False))
def umount(region, mountpoint):
    """Unmount a ckptfs mount (lazily if it is busy: it goes when its last user closes it)."""
    from ckptfs.fs import daemon

    entry = daemon.mount_entry(mountpoint)
    if region is not None and entry is not None and entry[1] != region.replace(",", "_") \
            and os.path.realpath(entry[1]) != os.path.realpath(region):
        raise daemon.MountError(f"{mountpoint} shows region {entry[1]}, not {region}")
    if daemon.umount(mountpoint) == "detached":
        click.echo(f"{mountpoint} is busy: detached it; it goes away when its last user closes it", err=True)
    return 0


@cli.command(name="install-mount-helper")
@click.option("--dir", "directory", default="/sbin", show_default=True, type=click.Path(file_okay=False),
              help="Where mount(8) looks for helpers.")
def install_mount_helper(directory):
    """Install the mount(8) helper (root), so that `mount -t fuse.ckptfs REGION DIR` and fstab
    lines work; it runs the ckptfs of this Python environment.

    \b
    fstab:  /var/lib/ckptfs/default.region  /ckpt  fuse.ckptfs  defaults,allow_other,nofail  0  0"""
    from ckptfs.fs import mounthelper

    if not os.path.isdir(directory):
        raise CkptfsError(f"no directory {directory}; give an existing one with --dir")
    for path in mounthelper.install(directory):
        click.echo(f"installed {path}")
    return 0


@cli.command(name="ls")
@_region_option
@_json_option
@click.option("-a", "--all", "show_all", is_flag=True,
              help="Also the models whose name starts with '.' (each rank's parts of a DCP checkpoint).")
@click.argument("model", required=False)
def ls_(region, as_json, show_all, model):
    """List the models, or the committed versions of MODEL."""
    with _open_store(region) as store:
        if model is None:
            rows = []
            for name in store.models():
                if name.startswith(".") and not show_all:
                    continue  # hidden, as in the mount: ranks' parts (.MODEL.rankN)
                versions = store.versions(name)
                latest = next((v for v in versions if v.latest), None)
                rows.append({"model": name, "versions": len(versions),
                             "latest_step": latest.step if latest else None,
                             "latest_bytes": latest.data_bytes if latest else 0,
                             "size": _size(store, latest) if latest else "-"})
            if as_json:
                click.echo(json.dumps([{k: v for k, v in r.items() if k != "size"} for r in rows], indent=1))
            else:
                _table([[r["model"], r["versions"], "-" if r["latest_step"] is None else r["latest_step"], r["size"]]
                        for r in rows], ["MODEL", "VERSIONS", "LATEST", "SIZE"])
            return 0
        versions = store.versions(model)
        if as_json:
            click.echo(json.dumps([_info_dict(v) for v in versions], indent=1))
        else:
            _table([[v.step, ", ".join(m for m, on in (("latest", v.latest), ("kept", v.kept)) if on), _when(v.time_ns),
                     _size(store, v), v.counter] for v in versions], ["STEP", "", "TIME", "SIZE", "COUNTER"])
        return 0


def _size(store, v) -> str:
    """A version's size as ls shows it; for a DCP checkpoint (no tensors of its own) the bytes of
    its ranks' parts, and how many ranks."""
    if v.data_bytes == 0:
        from ckptfs.dist.storage import checkpoint_bytes

        parts = checkpoint_bytes(store, v.model, v.step)
        if parts is not None:
            nbytes, ranks, elsewhere = parts
            return (f"{human_bytes(nbytes)} in {ranks} rank(s)"
                    + (f" ({elsewhere} on other nodes)" if elsewhere else ""))
    return human_bytes(v.data_bytes)


@cli.command()
@_region_option
@_json_option
@click.option("--step", type=STEP, help="The version: 1200 or step-00001200 (default: the latest).")
@click.argument("model")
def info(region, as_json, step, model):
    """Show one version of MODEL: step, time, tensors (dtype, shape, size, CRC32), files."""
    from ckptfs.dist.whole import as_whole, version_files
    from ckptfs.views import files_for

    with _open_store(region) as store:
        v, _ = as_whole(store, store.open_version(model, _version_step(store, model, step).step))
        with v:
            m = v.manifest  # a multi-rank version's whole tensors
            files = {name: view.size for name, view in version_files(v, files_for).items()}
            doc = dict(_info_dict(v.info), data_bytes=m.data_bytes, files=files, tensors=[
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
                 "crc32": f"{t.crc32:08x}"} for t in m.tensors])
        if as_json:
            click.echo(json.dumps(doc, indent=1))
            return 0
        click.echo(f"model    {doc['model']}")
        click.echo(f"step     {doc['step']}{' (latest)' if doc['latest'] else ''}")
        click.echo(f"time     {_when(doc['time_ns'])}")
        click.echo(f"counter  {doc['counter']}  slot {doc['slot']}")
        click.echo(f"data     {human_bytes(doc['data_bytes'])} in {len(doc['tensors'])} tensors")
        click.echo("files    " + ", ".join(f"{n} ({human_bytes(s)})" for n, s in files.items()))
        click.echo()
        _table([[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", human_bytes(t["nbytes"]), t["crc32"]]
                for t in doc["tensors"]], ["TENSOR", "DTYPE", "SHAPE", "SIZE", "CRC32"])
        return 0


@cli.command()
@_region_option
@click.option("--step", type=STEP, help="Only this version: 1200 or step-00001200 (needs MODEL).")
@click.argument("model", required=False)
def verify(region, step, model):
    """Check the CRC32 of every tensor of a version, of a model, or of the whole region.

    Exits 1 and prints one line per problem on a mismatch."""
    if step is not None and model is None:
        raise click.UsageError("--step needs a MODEL")
    with _open_store(region) as store:
        # a multi-rank model's versions hold its ranks' parts: those are checked with it
        names = [model, *_part_models(store, model)] if model else store.models()
        total = sum(v.data_bytes for name in names for v in store.versions(name) if step is None or v.step == step)
        with _progress(total, "verify") as bar:
            problems = store.verify(model, step, progress=bar.update)  # called with bytes just checked
            for name in names[1:] if model else ():
                if step is None or any(v.step == step for v in store.versions(name)):
                    problems += store.verify(name, step, progress=bar.update)
        for p in problems:
            click.echo(f"ckptfs: verify: {p}", err=True)
        what = f"{model} step {step}" if step is not None else (model or "the region")
        if problems:
            click.echo(f"ckptfs: {len(problems)} problem(s) in {what}", err=True)
            return 1
        click.echo(f"ok: {what} verified")
        return 0


@cli.command()
@_region_option
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
    from ckptfs.dist.whole import as_whole, version_files
    from ckptfs.views import files_for

    if key is not None:
        if file_name is not None:
            raise click.UsageError("give --file or --key, not both")
        file_name = f"{key}.safetensors"
    to_dir = output != "-" and (output.endswith(os.sep) or os.path.isdir(output))
    if output == "-" and file_name is None:
        raise click.UsageError("with OUTPUT -, choose the file with --file NAME or --key KEY")
    if not to_dir and file_name is None:
        file_name = _file_for_extension(output)
    parent = os.path.dirname(os.path.abspath(output.rstrip(os.sep) or os.sep))
    if output != "-" and not os.path.isdir(parent):
        raise CkptfsError(f"cannot write {output}: no directory {parent}")
    with _open_store(region) as store:
        v, _ = as_whole(store, store.open_version(model, _version_step(store, model, step).step))
        with v:
            views = version_files(v, files_for)
            if file_name is not None and file_name not in views:
                raise CkptfsError(f"{model} step {v.info.step} has no {file_name}; it has: {', '.join(views)}")
            names = [file_name] if file_name is not None else list(views)
            targets = {n: os.path.join(output, n) if to_dir else output for n in names}
            if not force:
                for dest in targets.values():
                    if dest != "-" and os.path.lexists(dest):
                        raise CkptfsError(f"{dest} exists; add --force to replace it")
            written, done = 0, []
            try:
                for name, dest in targets.items():
                    written += _export_file(views[name], v.data, dest)
                    done.append(dest)
            except BaseException:
                for dest in done:  # a version is exported whole or not at all
                    if dest != "-":
                        os.unlink(dest)
                raise
        if output != "-":
            what = file_name if file_name is not None else f"{len(names)} files"
            click.echo(f"exported {model} step {v.info.step} {what} to {output} ({human_bytes(written)})")
        return 0


def _file_for_extension(output: str) -> str:
    """The version's file that an output name asks for by its extension (UsageError if none)."""
    ext = os.path.splitext(output)[1].lower()
    names = {".pt": "checkpoint.pt", ".pth": "checkpoint.pt", ".safetensors": "state.safetensors",
             ".json": "metadata.json"}
    if ext not in names:
        raise click.UsageError(f"cannot tell the format from {output!r}; choose it with --file NAME, "
                               "or give a directory to export every file")
    return names[ext]


def _export_file(view, data, dest: str) -> int:
    """Stream one view of a version to ``dest`` (``-``: standard output), checked as it goes;
    a file appears only whole (written beside it, then renamed). Returns its size."""
    if dest == "-":
        out = click.get_binary_stream("stdout")
        for block in view.iter_blocks(data.sequential_reader(), EXPORT_BLOCK_BYTES):
            out.write(block)
        out.flush()
        data.confirm()
        return view.size
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)  # views' subdirectories (hf/)
    tmp = dest + ".ckptfs-part"
    try:
        with open(tmp, "wb") as f, _progress(view.size, os.path.basename(dest)) as bar:
            # checked as it streams: a damaged tensor fails the export before the file is renamed
            for block in view.iter_blocks(data.sequential_reader(), EXPORT_BLOCK_BYTES):
                f.write(block)
                bar.update(len(block))
        data.confirm()  # the blocks were views of the mapping: none read a faulted page
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return view.size


@cli.command(name="import")
@_region_option
@click.option("--step", type=STEP, help="Step of the new version (default: one past the latest, or 0).")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]),
              help="Default: from the extension, else from the first bytes.")
@click.option("--key", metavar="KEY", help="Store the tensors of a .safetensors under this top-level key.")
@click.argument("model")
@click.argument("file", type=click.Path(dir_okay=False))
def import_(region, step, fmt, key, model, file):
    """Import FILE (.safetensors, or a torch.save file) as a new version of MODEL.

    The file is validated completely first; malformed or hostile input is refused with nothing
    written. Torch files are read with torch.load(weights_only=True)."""
    from ckptfs.importer import import_file

    with _open_store(region, create=True) as store:
        v = import_file(store, model, file, step=step, fmt=fmt, key=key)
        click.echo(f"imported {file} as {model} step {v.step} ({human_bytes(v.data_bytes)})")
        return 0


@cli.command()
@_region_option
@click.option("--all", "all_", is_flag=True, help="Remove MODEL itself with every version.")
@click.option("--step", "step_options", type=STEP, multiple=True,
              help="A version to remove (repeatable; the same as a STEPS argument).")
@click.argument("model")
@click.argument("steps", nargs=-1, type=STEP)
def rm(region, all_, step_options, model, steps):
    """Remove versions STEPS of MODEL (1200 or step-00001200; not the latest, not while pinned),
    or the model with --all."""
    steps = tuple(step_options) + tuple(steps)
    if all_ == bool(steps):
        raise click.UsageError("give the STEPS to remove, or --all (and no steps) to remove the whole model")
    with _open_store(region) as store:
        if all_:
            store.remove_model(model)
            click.echo(f"removed {model}")
        for s in steps:
            store.remove(model, s)
            click.echo(f"removed {model} step {s}")
        return 0


@cli.command()
@_region_option
def upgrade(region):
    """Copy the region, written by an older ckptfs (format 1), into the current format: every
    version is copied and checked, the old file is kept as PATH.format1, then the copy takes its
    name."""
    from ckptfs.region.upgrade import upgrade as run
    from ckptfs.store import default_region_path

    region_path = region or default_region_path()
    for model, n in run(region_path):
        click.echo(f"upgraded {model}: {n} version(s)")
    click.echo(f"{region_path} now uses the current format; the old region is {region_path}.format1")
    return 0


@cli.command()
@_region_option
@click.argument("model")
@click.argument("steps", nargs=-1, type=STEP, required=True)
def keep(region, model, steps):
    """Keep versions STEPS of MODEL (milestones): the ring never reuses them until `ckptfs unkeep`
    or `ckptfs rm`; each takes its slot out of the ring, which takes another from free space."""
    return _set_kept(region, model, steps, True)


@cli.command()
@_region_option
@click.argument("model")
@click.argument("steps", nargs=-1, type=STEP, required=True)
def unkeep(region, model, steps):
    """Give kept versions STEPS of MODEL back to the ring (reused once older than what it keeps)."""
    return _set_kept(region, model, steps, False)


def _set_kept(region, model: str, steps, kept: bool) -> int:
    with _open_store(region) as store:
        for s in steps:
            (store.keep if kept else store.unkeep)(model, s)
            click.echo(f"{'kept' if kept else 'unkept'} {model} step {s}")
    return 0


@cli.command()
@_region_option
@_json_option
def status(region, as_json):
    """Region usage, models, and the saves in flight with their progress."""
    with _open_store(region) as store:
        st = store.status()
    if as_json:
        click.echo(json.dumps(st, indent=1, default=str))
        return 0
    click.echo(f"region   {st['path']} ({st['kind']}): {human_bytes(st['region_bytes'])}, "
               f"{human_bytes(st['used_bytes'])} in model rings, {human_bytes(st['free_bytes'])} free")
    click.echo()
    _table([[m["name"], m["versions"], "-" if m["latest_step"] is None else m["latest_step"],
             " ".join(map(str, m["kept_steps"])) or "-", f"{m['slots']} (keeps {m['ring_slots']})",
             human_bytes(m["slot_bytes"]), m["saves_in_flight"]] for m in st["models"]],
           ["MODEL", "VERSIONS", "LATEST", "KEPT", "SLOTS", "SLOT SIZE", "WRITING"])
    pins = [(m["name"], p) for m in st["models"] for p in m["pinned"]]
    click.echo()
    if not pins:
        click.echo("no versions pinned by readers")
    else:
        _table([[name, p["step"], " ".join(f"{pid} ({cmd})" for pid, cmd in p["holders"]) or "?"]
                for name, p in pins], ["PINNED", "STEP", "BY PROCESS"])
    saves = st.get("saves_in_flight") or []
    click.echo()
    if not saves:
        click.echo("no saves in flight")
    else:
        _table([[sv["model"], sv["step"], f"{human_bytes(sv['persisted_bytes'])} / {human_bytes(sv['total_bytes'])}",
                 f"{100 * sv['persisted_bytes'] / max(sv['total_bytes'], 1):.0f}%", sv["pid"]] for sv in saves],
               ["SAVING", "STEP", "PERSISTED", "", "PID"])
    return 0


# ------------------------------------------------------------------------------ entry point


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit with its status. Errors: one line on stderr, never a traceback
    (unless CKPTFS_DEBUG=1)."""
    from ckptfs.fs.daemon import MountError

    debug = os.environ.get("CKPTFS_DEBUG", "") not in ("", "0")
    try:
        with cli_words():
            rv = cli.main(args=argv, prog_name="ckptfs", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # one line, as every other error
        where = exc.ctx.command_path if exc.ctx is not None else "ckptfs"
        click.echo(f"{where}: usage: {_one_line(exc)} (see `{where} --help`)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("ckptfs: interrupted", err=True)
        sys.exit(130)
    except (CkptfsError, MountError, OSError, ValueError) as exc:  # ValueError: a bad argument
        if debug:
            raise
        click.echo(f"ckptfs: error: {_one_line(exc)}", err=True)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - never a traceback for the user
        if debug:
            raise
        click.echo(f"ckptfs: internal error: {type(exc).__name__}: {_one_line(exc)} "
                   "(run with CKPTFS_DEBUG=1 for details)", err=True)
        sys.exit(70)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
