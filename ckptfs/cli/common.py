"""What the ``ckptfs`` commands share: the command group, ``--region`` and ``--json``, steps as
users write them, tables, progress bars and one-line errors."""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import sys
import warnings
from typing import Any

import click

from ckptfs.units import human_bytes


def region_option(f):
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


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def part_models(store, model: str) -> list[str]:
    from ckptfs.dist.names import part_models

    return part_models(store, model)


def open_store(region: str | None, *, create: bool = False):
    """The region of --region (default: the per-user one). Only commands that write (mount,
    import) may create the default region; the others say that there is none yet."""
    from ckptfs import Store

    store = Store(region, create=create)
    if store.created:
        # it was made without a word: 64 GiB sparse on a filesystem of 80 MiB, found by `status` alone
        click.echo(f"ckptfs: created the region {store.path} ({human_bytes(store.region.superblock.region_bytes)}, "
                   "a sparse file: blocks are taken as saves write; `ckptfs mkfs --size` makes one of another "
                   "size)", err=True)
    return store


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
        from ckptfs.region.format import STEP_LIMIT

        if step is None:
            self.fail(f"{value!r} is not a step (e.g. 1200 or step-00001200)", param, ctx)
        if step >= STEP_LIMIT:
            self.fail(f"{value!r} is past the last step (2**62 - 1)", param, ctx)
        return step


STEP = _Step()


def parse_size(text: str) -> int:
    """'64G', '512MiB', '1.5T', '4096' -> bytes (binary multiples)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 64G, 512M, 4096)")
    scale = 1024 ** "bkmgtp".index((m.group(2) or "b").lower())
    return int(float(m.group(1)) * scale)


def say(level: str, text: str) -> None:
    """A command's line other than its output (``level``: warning, error): one line on stderr,
    ``ckptfs: <level>: <text>``, the library's own too (``cli_lines``)."""
    click.echo(f"ckptfs: {level}: {' '.join(text.split())}", err=True)


def warn(text: str) -> None:
    say("warning", text)


class _Lines(logging.Handler):
    """The library's log records (WARNING and above) as the CLI's lines (``say``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(record.levelname.lower(), record.getMessage().removeprefix("ckptfs: "))
        except Exception:  # noqa: BLE001 - a log call never raises into the library (as logging's own)
            self.handleError(record)


_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_shown_before = []  # warnings.showwarning as cli_lines found it, while it is replaced


@contextlib.contextmanager
def cli_lines():
    """While a command runs, the library's warnings (its log records and its ``warnings.warn``)
    come out as the command's own: one line each, ``ckptfs: warning: ...`` (without it, log
    records came out bare, and a warning with its file and line)."""
    logger = logging.getLogger("ckptfs")
    handler = _Lines(logging.WARNING)
    logger.addHandler(handler)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not str(filename).startswith(_PACKAGE_DIR):  # another library's (torch's): as Python shows it
            shown(message, category, filename, lineno, file, line)
            return
        try:
            warn(str(message))
        except OSError:
            pass  # stderr gone (as Python's own showwarning)

    warnings.showwarning = show
    _shown_before.append(shown)
    try:
        yield
    finally:
        stop_cli_lines()


def stop_cli_lines() -> None:
    """The library's lines as Python gives them again (for a mount's daemon, which logs with its
    own handler: time, pid; its stderr is closed once it is mounted)."""
    logger = logging.getLogger("ckptfs")
    for handler in [h for h in logger.handlers if isinstance(h, _Lines)]:
        logger.removeHandler(handler)
    if _shown_before:
        warnings.showwarning = _shown_before[0]
        _shown_before.clear()


def when(time_ns: int) -> str:
    return datetime.datetime.fromtimestamp(time_ns / 1e9).isoformat(sep=" ", timespec="seconds")


def shown(text: str) -> str:
    """``text`` with what a terminal cannot show as it is escaped as Python writes it: a
    newline or NUL in a key made a bogus row, and a lone surrogate ended ``info`` with an
    encoding error half-way."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [header] + [[shown(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    # one write: an echo per row was a third of `info` of a version of 40,000 tensors
    click.echo("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells))


def info_dict(v) -> dict:
    return {"model": v.model, "step": v.step, "counter": v.counter, "slot": v.slot,
            "time_ns": v.time_ns, "data_bytes": v.data_bytes, "latest": bool(v.latest), "kept": bool(v.kept)}


def progress(total: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False)


def version_step(store, model: str, step: int | None):
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
    with store.open_version(model, step, whole=False):  # the Store's words: a step whose header is damaged is "damaged"
        pass
    raise no_step(model, step)


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


def one_line(exc: BaseException) -> str:
    """An error as the one line the CLI prints: an OSError's text and file, else the message
    with its whitespace folded."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
