"""Process-level reliability runs: SIGKILLed writers, a SIGKILLed mount daemon, sustained load.

Children are started from a forkserver (``mp_context``): a clean single-threaded parent for every
child, as tests/conftest.py does. Every child reports through files (O_APPEND lines, or a JSON
result), so a kill loses nothing the parent needs.

* :func:`kill_rounds` -- a writer saving two models, N in flight, SIGKILLed at a random moment,
  round after round on the same region: after each kill the region opens, each model's latest
  verifies and is exactly the state saved at its step, and no step whose future had completed is
  newer than the latest (tests/test_crash.py's check, here reusable at any scale);
* :func:`mount_kill_rounds` -- readers hold files open in the mount while the daemon is SIGKILLed
  and a writer keeps saving: the writer never notices, no pin outlives the daemon, the next mount
  works and serves the latest;
* :func:`sustained_load` -- one writer checkpointing every iteration with N in flight, 4 readers
  reading random versions through the mount and through ``Store.load`` and comparing with the
  expected content, one process running ``verify``, for a bounded time; mismatches and errors
  other than "version gone" are counted, and the memory of the writer and the daemon is sampled.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
import traceback
import zlib
from dataclasses import dataclass, field

import torch

import ckptfs
from ckptfs.errors import NotFoundError
from ckptfs.testing.crashcheck import same
from ckptfs.testing.mounts import start_mount, wait_unmounted

KILL_MODELS = ("alpha", "beta")


# What the children of the tests and benchmarks import, imported once by the fork server: each
# child is forked from it. A child still imports the module of its target function (a test
# file), and with it everything that module imports which is not here: DCP alone took 0.9 s of
# each child's start, pytest and hypothesis 0.3 s, on the 2-core VM (a round of a kill test
# 1.4 -> 0.3 s). A module that does not import is skipped (the fork server's rule).
FORKSERVER_PRELOAD = ["torch", "ckptfs", "ckptfs.testing.ranks", "torch.distributed.checkpoint",
                      "torch.distributed.fsdp", "pytest", "hypothesis"]


def mp_context():
    """The multiprocessing context of the tests' children (ranks, writers to kill): a fork
    server with FORKSERVER_PRELOAD imported. Forked from a process with no thread of the
    parent's (a fork of the pytest process would copy its threads' locks as they are)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------ writer kills

def kill_state(model: str, step: int):
    g = torch.Generator().manual_seed(zlib.crc32(f"{model}:{step}".encode()))
    return {"model": {"w": torch.randn(96, 96, generator=g), "b": torch.full((300,), float(step))},
            "optim": {"step": step, "lr": 0.1 / (step + 1), "name": model}}


def _save_forever(region_path: str, start_step: int, report_path: str) -> None:
    # O_APPEND writes survive the kill; a line is written only after its save is durable.
    report_fd = os.open(report_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    store = ckptfs.Store(region_path)
    writers = {m: store.writer(m, max_inflight=2, chunk_bytes=16384, slots=4) for m in KILL_MODELS}
    step = start_step
    os.write(report_fd, b"ready\n")
    while True:
        futs = {m: w.save(kill_state(m, step), step=step) for m, w in writers.items()}
        for m, f in futs.items():
            f.add_done_callback(lambda f, m=m, s=step: f.exception() is None and
                                os.write(report_fd, f"{m} {s}\n".encode()))
        step += 1


@dataclass
class KillReport:
    rounds: int = 0
    survived: int = 0
    saves_confirmed: int = 0
    failures: list = field(default_factory=list)
    seconds: float = 0.0


def kill_rounds(region_path: str, rounds: int, seed: int = 0, max_delay_s: float = 0.2,
                progress=None) -> KillReport:
    """See the module doc. ``region_path`` is created (or reused, if it is a region)."""
    if not os.path.exists(region_path):
        ckptfs.Store.create(region_path, size_bytes=256 << 20).close()
    ctx = mp_context()
    rng = random.Random(seed)
    report = KillReport()
    durable: dict[str, int] = {}
    step = 0
    started = time.monotonic()
    for round_no in range(rounds):
        report.rounds += 1
        report_path = f"{region_path}.kill-report"
        if os.path.exists(report_path):
            os.unlink(report_path)
        child = ctx.Process(target=_save_forever, args=(region_path, step, report_path))
        child.start()
        deadline = time.monotonic() + 60
        try:
            while not (os.path.exists(report_path) and open(report_path, "rb").read(6) == b"ready\n"):
                if not child.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the saving child failed to start")
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, max_delay_s))
        finally:
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
            child.join()
        with open(report_path) as f:
            for line in f.read().split("\n")[1:]:
                if line:
                    m, s = line.split()
                    durable[m] = max(durable.get(m, -1), int(s))
                    report.saves_confirmed += 1
        fails = []
        try:
            with ckptfs.Store(region_path) as s:  # a fresh open, as after a real crash
                for m in KILL_MODELS:
                    latest = s.latest(m) if m in s.models() else None
                    if latest is None:
                        if m in durable:
                            fails.append(f"{m}: no latest but step {durable[m]} was confirmed")
                        continue
                    if latest.step < durable.get(m, -1):
                        fails.append(f"{m}: latest step {latest.step} older than confirmed step {durable[m]}")
                    newest = max(s.versions(m), key=lambda v: v.counter)
                    if newest.counter != latest.counter:
                        fails.append(f"{m}: latest is step {latest.step} but step {newest.step} is newer")
                    problems = s.verify(m, latest.step)
                    if problems:
                        fails.append(f"{m}: verify: {problems}")
                    diff = same(kill_state(m, latest.step), s.load(m))
                    if diff:
                        fails.append(f"{m} step {latest.step}: {diff}")
                    step = max(step, latest.step + 1)
                problems = s.verify()
                if problems:
                    fails.append(f"verify of the region: {[str(p) for p in problems]}")
        except Exception as e:  # noqa: BLE001 - a failure to open or read is a finding
            fails.append(f"{type(e).__name__}: {e}")
        step += 100  # the next round's steps differ from anything half-written
        if fails:
            report.failures.append(f"round {round_no}: " + "; ".join(fails))
        else:
            report.survived += 1
        if progress:
            progress(report)
    report.seconds = time.monotonic() - started
    return report


# ------------------------------------------------------------------------------ shared children

def load_state(step: int, n: int = 1 << 16):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(step % 97, dtype=torch.int32), "step": step}


def _writer(region_path: str, model: str, inflight: int, iter_s: float, stop_path: str, report_path: str,
            n: int) -> None:
    out = {"saves": 0, "errors": [], "rss": []}
    try:
        with ckptfs.Store(region_path) as store:
            # 1 MiB chunks: the pool's pre-faulted buffers then match these small checkpoints (with
            # the 64 MiB default, the second buffer alone is a 64 MiB step of RSS whenever two
            # saves first overlap -- bounded by the staging budget, but not what "flat" measures)
            with store.writer(model, max_inflight=inflight, slots=inflight + 7, timeout_s=60,
                              chunk_bytes=1 << 20) as w:
                step, last_rss = 0, 0.0
                while not os.path.exists(stop_path):
                    time.sleep(iter_s)  # the iteration's compute
                    fut = w.save(load_state(step, n), step)
                    fut.add_done_callback(lambda f: f.exception() and out["errors"].append(repr(f.exception())))
                    out["saves"] += 1
                    step += 1
                    if time.monotonic() - last_rss > 1:
                        last_rss = time.monotonic()
                        out["rss"].append(rss_bytes(os.getpid()))
    except BaseException as e:  # noqa: BLE001
        out["errors"].append("".join(traceback.format_exception_only(type(e), e)).strip())
    with open(report_path, "w") as f:
        json.dump(out, f)


def _reader(region_path: str, mountpoint: str | None, model: str, seed: int, stop_path: str,
            report_path: str, n: int) -> None:
    from ckptfs.fs.names import version_dirname

    rng = random.Random(seed)
    out = {"store_reads": 0, "mount_reads": 0, "gone": 0, "mismatches": [], "errors": []}
    store = ckptfs.Store(region_path)
    try:
        while not os.path.exists(stop_path):
            try:
                versions = store.versions(model)
            except NotFoundError:
                time.sleep(0.01)
                continue
            if not versions:
                time.sleep(0.01)
                continue
            step = rng.choice(versions).step
            via_mount = mountpoint is not None and rng.random() < 0.5
            try:
                if via_mount:
                    name = "latest" if rng.random() < 0.2 else version_dirname(step)
                    got = torch.load(os.path.join(mountpoint, model, name, "checkpoint.pt"), weights_only=True)
                    step = got["step"] if name == "latest" else step
                    out["mount_reads"] += 1
                else:
                    got = store.load(model, step)
                    out["store_reads"] += 1
                diff = same(load_state(step, n), got)
                if diff:
                    out["mismatches"].append(f"{'mount' if via_mount else 'load'} step {step}: {diff}")
            except (NotFoundError, FileNotFoundError):
                out["gone"] += 1  # documented: the version was reused between listing and opening
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"{'mount' if via_mount else 'load'} step {step}: {type(e).__name__}: {e}")
    finally:
        store.close()
        with open(report_path, "w") as f:
            json.dump(out, f)


def _verifier(region_path: str, model: str, stop_path: str, report_path: str) -> None:
    out = {"verifies": 0, "problems": [], "errors": []}
    with ckptfs.Store(region_path) as store:
        while not os.path.exists(stop_path):
            try:
                problems = store.verify(model)
                out["problems"] += [str(p) for p in problems]
                out["verifies"] += 1
            except NotFoundError:
                time.sleep(0.01)
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"{type(e).__name__}: {e}")
            time.sleep(0.05)
    with open(report_path, "w") as f:
        json.dump(out, f)


def _holder(mountpoint: str, model: str, ready_path: str) -> None:
    """Open every file of the latest version through the mount and keep them open."""
    d = os.path.join(mountpoint, model, "latest")
    files = [open(os.path.join(d, name), "rb") for name in sorted(os.listdir(d))]
    for f in files:
        f.read(4096)
    with open(ready_path, "w") as r:
        r.write(str(len(files)))
    while True:
        for f in files:
            try:
                f.seek(0)
                f.read(4096)
            except OSError:
                pass  # the daemon is gone: ENOTCONN
        time.sleep(0.05)


# ------------------------------------------------------------------------------ sustained load

@dataclass
class LoadReport:
    seconds: float = 0.0
    saves: int = 0
    store_reads: int = 0
    mount_reads: int = 0
    verifies: int = 0
    gone: int = 0
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    writer_rss: tuple = (0, 0)
    daemon_rss: tuple = (0, 0)

    @property
    def reads(self) -> int:
        return self.store_reads + self.mount_reads


def sustained_load(workdir: str, seconds: float, *, readers: int = 4, inflight: int = 2, iter_s: float = 0.05,
                   mount: bool = True, n: int = 1 << 16) -> LoadReport:
    os.makedirs(workdir, exist_ok=True)
    region = os.path.join(workdir, "load.region")
    ckptfs.Store.create(region, size_bytes=1 << 30, force=True).close()
    model = "trainer"
    stop = os.path.join(workdir, "stop")
    if os.path.exists(stop):
        os.unlink(stop)
    mnt = start_mount(region, os.path.join(workdir, "mnt")) if mount else None
    ctx = mp_context()
    reports = {k: os.path.join(workdir, f"{k}.json") for k in
               ["writer", "verifier"] + [f"reader{i}" for i in range(readers)]}
    procs = [ctx.Process(target=_writer, args=(region, model, inflight, iter_s, stop, reports["writer"], n))]
    procs += [ctx.Process(target=_reader, args=(region, mnt.path if mnt else None, model, i, stop,
                                                reports[f"reader{i}"], n)) for i in range(readers)]
    procs.append(ctx.Process(target=_verifier, args=(region, model, stop, reports["verifier"])))
    report = LoadReport()
    t0 = time.monotonic()
    try:
        for p in procs:
            p.start()
        daemon_rss = []
        while time.monotonic() - t0 < seconds:
            time.sleep(min(1.0, seconds / 10))
            if mnt:
                daemon_rss.append(rss_bytes(mnt.proc.pid))
            if any(not p.is_alive() for p in procs):
                report.errors.append("a load process died early: " +
                                     ", ".join(f"{p.name} rc={p.exitcode}" for p in procs if not p.is_alive()))
                break
        open(stop, "w").close()
        for p in procs:
            p.join(120)
            if p.is_alive():
                report.errors.append(f"{p.name} did not stop (deadlock?)")
                p.kill()
                p.join()
    finally:
        open(stop, "w").close()
        if mnt:
            mnt.stop()
    report.seconds = time.monotonic() - t0
    for name, path in reports.items():
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            report.errors.append(f"{name} left no report")
            continue
        report.errors += [f"{name}: {e}" for e in doc.get("errors", [])]
        report.mismatches += doc.get("mismatches", []) + [f"verify: {p}" for p in doc.get("problems", [])]
        report.saves += doc.get("saves", 0)
        report.store_reads += doc.get("store_reads", 0)
        report.mount_reads += doc.get("mount_reads", 0)
        report.gone += doc.get("gone", 0)
        report.verifies += doc.get("verifies", 0)
        if name == "writer" and doc.get("rss"):
            rss = doc["rss"]
            report.writer_rss = (rss[len(rss) // 4], rss[-1])
    if mnt and daemon_rss:
        report.daemon_rss = (daemon_rss[len(daemon_rss) // 4], daemon_rss[-1])
    return report


# ------------------------------------------------------------------------------ daemon kills

@dataclass
class MountKillReport:
    rounds: int = 0
    survived: int = 0
    failures: list = field(default_factory=list)


def mount_kill_rounds(workdir: str, rounds: int, seed: int = 0, holders: int = 2) -> MountKillReport:
    """See the module doc."""
    from ckptfs.region.locks import slot_lock_offset

    rng = random.Random(seed)
    os.makedirs(workdir, exist_ok=True)
    region = os.path.join(workdir, "mk.region")
    ckptfs.Store.create(region, size_bytes=512 << 20, force=True).close()
    model = "trainer"
    ctx = mp_context()
    report = MountKillReport()
    stop = os.path.join(workdir, "mk-stop")
    for r in range(rounds):
        report.rounds += 1
        fails = []
        if os.path.exists(stop):
            os.unlink(stop)
        writer_report = os.path.join(workdir, "mk-writer.json")
        writer = ctx.Process(target=_writer, args=(region, model, 2, 0.02, stop, writer_report, 1 << 14))
        writer.start()
        mnt = None
        kids = []
        try:
            with ckptfs.Store(region) as s:
                deadline = time.monotonic() + 60
                while model not in s.models() or s.latest(model) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the writer saved nothing")
                    time.sleep(0.02)
            mnt = start_mount(region, os.path.join(workdir, "mk-mnt"))
            readies = [os.path.join(workdir, f"mk-ready{i}") for i in range(holders)]
            for p in readies:
                if os.path.exists(p):
                    os.unlink(p)
            kids = [ctx.Process(target=_holder, args=(mnt.path, model, p), daemon=True) for p in readies]
            for k in kids:
                k.start()
            deadline = time.monotonic() + 30
            while not all(os.path.exists(p) and open(p).read() for p in readies):
                if time.monotonic() > deadline or any(not k.is_alive() for k in kids):
                    raise RuntimeError("the readers could not open files in the mount")
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.3))
            os.kill(mnt.proc.pid, signal.SIGKILL)  # readers hold open files, the writer saves
            mnt.proc.wait()
            if not wait_unmounted(mnt.path):
                fails.append("the dead daemon's mount was not taken down (auto_unmount)")
            for k in kids:
                os.kill(k.pid, signal.SIGKILL)
                k.join()
            kids = []
            time.sleep(rng.uniform(0, 0.2))
            open(stop, "w").close()
            writer.join(60)
            with open(writer_report) as f:
                wdoc = json.load(f)
            if wdoc["errors"]:
                fails.append(f"the writer noticed: {wdoc['errors']}")
            with ckptfs.Store(region) as s:
                entry = s.region.get(model)
                stale = [slot for slot in entry.slots()
                         if s.region.pins.is_locked_by_others(slot_lock_offset(entry.index, slot))]
                if stale:
                    fails.append(f"slots {stale} are still pinned after the daemon and the readers died")
                latest = s.latest(model)
                if s.verify(model):
                    fails.append(f"verify: {s.verify(model)}")
            mnt2 = start_mount(region, os.path.join(workdir, "mk-mnt"))
            try:
                got = torch.load(os.path.join(mnt2.path, model, "latest", "checkpoint.pt"), weights_only=True)
                diff = same(load_state(latest.step, 1 << 14), got)
                if diff or got["step"] != latest.step:
                    fails.append(f"the next mount serves the wrong latest: {diff}")
            finally:
                mnt2.stop()
        except Exception as e:  # noqa: BLE001
            fails.append(f"{type(e).__name__}: {e}")
        finally:
            open(stop, "w").close()
            for k in kids:
                k.kill()
                k.join()
            writer.join(60)
            if writer.is_alive():
                writer.kill()
                fails.append("the writer did not stop")
            if mnt is not None:
                mnt.stop()
        if fails:
            report.failures.append(f"round {r}: " + "; ".join(fails))
        else:
            report.survived += 1
    return report
