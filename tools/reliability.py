#!/usr/bin/env python3
"""Run the whole reliability harness at scale and print what ckptfs survived (issue 4).

    python tools/reliability.py --quick          # a few minutes
    python tools/reliability.py                  # the long version (tens of minutes)
    python tools/reliability.py --kills 5000 --only kills

Sections (``--only`` picks some):
  crash    lost-write crash images of a recorded multi-model run (ckptfs.testing.crashsim)
  kills    a writer SIGKILLed at random moments, round after round (ckptfs.testing.load)
  mount    the mount daemon SIGKILLed while readers hold files open and a writer saves
  faults   random media faults at rest (ckptfs.testing.faults)
  anomaly  every I/O call of a save failing in turn, EIO / ENOSPC / EROFS, every mapped step
           of a devdax save meeting a bad page, and the staging allocation failing
           (ckptfs.testing.anomaly)
  hostile  the property tests of tests/test_hostile.py with many more examples
  load     sustained load: writer + 4 readers (mount and Store.load) + verify

Exit status 0 only if every check passed. Needs /dev/fuse for ``mount`` and the mount half of
``load`` (they are reported as not run without it).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

QUICK = dict(crash_seeds=1, crash_points=150, exhaustive=16, samples=6, tears=2, continue_every=40,
             kills=40, mount_kills=2, faults=300, hostile=100, load_seconds=20)
FULL = dict(crash_seeds=4, crash_points=0, exhaustive=64, samples=16, tears=6, continue_every=10,
            kills=1000, mount_kills=20, faults=3000, hostile=2000, load_seconds=120)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_crash(a, workdir, rows, failures):
    from ckptfs.testing.crashsim import CrashSim, CrashSimReport, record_scenario

    total = CrashSimReport()
    for seed in range(a.crash_seeds):
        d = os.path.join(workdir, f"crash{seed}")
        rec = record_scenario(d, seed=seed)
        log(f"crash: seed {seed}: recorded {rec.stats['Write']} writes, {rec.stats['BarrierEnd']} barriers, "
            f"{rec.stats['saves']} saves ({rec.stats['out_of_order_commits']} out of order)")
        sim = CrashSim(rec, d, seed=seed, exhaustive_limit=a.exhaustive, samples=a.samples, tears=a.tears,
                       max_points=a.crash_points or None, continue_every=a.continue_every, max_failures=50)
        r = sim.run()
        log(f"crash: seed {seed}: {r.images} images at {r.crash_points_tested} points, "
            f"{len(r.failures)} failures, {r.seconds:.0f} s")
        total.merge(r)
    rows.append(("crash images tested",
                 f"{total.images} images at {total.crash_points_tested} crash points "
                 f"({total.exhaustive_points} exhaustive, {total.sampled_points} sampled); "
                 f"{total.torn_images} with torn writes; {total.continued} continued with a new save; "
                 f"up to {total.max_pending_writes} writes + {total.max_pending_words} table words pending",
                 len(total.failures)))
    failures += [f"crash: {f}" for f in total.failures]


def run_kills(a, workdir, rows, failures):
    from ckptfs.testing.load import kill_rounds

    def progress(r):
        if r.rounds % 100 == 0:
            log(f"kills: {r.survived}/{r.rounds} survived")

    r = kill_rounds(os.path.join(workdir, "kills.region"), a.kills, seed=a.seed, progress=progress)
    rows.append(("writer SIGKILLs survived", f"{r.survived} of {r.rounds} rounds "
                 f"({r.saves_confirmed} saves confirmed before the kills, {r.seconds:.0f} s)", len(r.failures)))
    failures += [f"kills: {f}" for f in r.failures]


def run_mount(a, workdir, rows, failures):
    from ckptfs.testing.load import mount_kill_rounds
    from ckptfs.testing.mounts import fuse_available

    if not fuse_available():
        rows.append(("mount daemon SIGKILLs survived", "not run: no /dev/fuse", 0))
        return
    r = mount_kill_rounds(os.path.join(workdir, "mount"), a.mount_kills, seed=a.seed)
    rows.append(("mount daemon SIGKILLs survived", f"{r.survived} of {r.rounds} (files open, writer saving)",
                 len(r.failures)))
    failures += [f"mount: {f}" for f in r.failures]


def run_faults(a, workdir, rows, failures):
    from ckptfs.testing.faults import run_campaign

    r = run_campaign(a.faults, seed=a.seed, workdir=workdir)
    rows.append(("media faults injected / detected",
                 f"{r.injected} injected: {r.detected} detected ({r.repaired} of them in one copy of a mirrored "
                 f"header or table entry, repaired from the other by the model's next writer), {r.harmless} in "
                 f"meaningless bytes (correctly silent), {r.undetectable} lost without a report; over "
                 f"{len(r.by_kind)} kinds of site",
                 len(r.failures)))
    failures += [f"faults: {f}" for f in r.failures]


def run_anomaly(a, workdir, rows, failures):
    from ckptfs.testing.anomaly import campaign

    r = campaign(workdir)
    ops = ", ".join(f"{op} {n}" for op, n in sorted(r.by_operation().items()))
    rows.append(("I/O anomalies (each save-path call failing in turn)",
                 f"{len(r.runs)} saves, {r.faults} faults injected (EIO, ENOSPC, EROFS; devdax bad pages; "
                 "staging allocation): "
                 f"{ops}", len(r.failures)))
    failures += [f"anomaly: {f}" for f in r.failures]


def run_hostile(a, workdir, rows, failures):
    import pytest

    os.environ["CKPTFS_HYPOTHESIS_EXAMPLES"] = str(a.hostile)
    os.environ["CKPTFS_HYPOTHESIS_RANDOM"] = "1"

    class Collect:
        def __init__(self):
            self.failed = []

        def pytest_runtest_logreport(self, report):
            if report.failed:
                self.failed.append(f"{report.nodeid}: {str(report.longrepr).splitlines()[-1][:300]}")

    collect = Collect()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:warnings", "--no-header", "--tb=line",
                        "--rootdir", ROOT, "--basetemp", os.path.join(workdir, "hostile"),
                        os.path.join(ROOT, "tests", "test_hostile.py")], plugins=[collect])
    mod = sys.modules.get("test_hostile") or sys.modules.get("tests.test_hostile")
    tried = mod.TRIED["n"] if mod else 0
    rows.append(("hostile inputs tried", f"{tried} (parsers, crafted regions, names, importer)",
                 len(collect.failed) or int(code not in (0, 5))))
    failures += [f"hostile: {f}" for f in collect.failed]


def run_load(a, workdir, rows, failures):
    from ckptfs.testing.load import sustained_load
    from ckptfs.testing.mounts import fuse_available

    mount = fuse_available()
    r = sustained_load(os.path.join(workdir, "load"), a.load_seconds, mount=mount)
    mib = lambda pair: f"{pair[0] >> 20}->{pair[1] >> 20} MiB"  # noqa: E731
    rows.append(("sustained load", f"{r.seconds:.0f} s: {r.saves} saves; {r.reads} reads checked "
                 f"({r.mount_reads} through the mount{'' if mount else ' (no FUSE)'}, {r.store_reads} Store.load), "
                 f"{r.verifies} verify passes, {r.gone} 'version gone'; RSS writer {mib(r.writer_rss)}, "
                 f"daemon {mib(r.daemon_rss)}", len(r.mismatches) + len(r.errors)))
    failures += [f"load: {f}" for f in r.mismatches + r.errors]


SECTIONS = {"crash": run_crash, "kills": run_kills, "mount": run_mount, "faults": run_faults, "anomaly": run_anomaly,
            "hostile": run_hostile, "load": run_load}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the bounded version (minutes)")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="where the regions go (default: a temporary directory)")
    for k in FULL:
        p.add_argument("--" + k.replace("_", "-"), type=type(FULL[k]), default=None)
    a = p.parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    logging.getLogger("ckptfs").setLevel(logging.ERROR)
    rows, failures = [], []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=a.workdir, prefix="ckptfs-reliability-") as workdir:
        for name in a.only.split(","):
            t0 = time.monotonic()
            log(f"{name}: starting")
            try:
                SECTIONS[name](a, workdir, rows, failures)
            except Exception as e:  # noqa: BLE001 - a crash of the harness is a failure too
                rows.append((name, f"the harness failed: {type(e).__name__}: {e}", 1))
                failures.append(f"{name}: {type(e).__name__}: {e}")
            log(f"{name}: done in {time.monotonic() - t0:.0f} s")
    total = sum(n for _, _, n in rows)
    width = max(len(r[0]) for r in rows)
    print(f"\nckptfs reliability ({'quick' if a.quick else 'full'}, seed {a.seed}, "
          f"{time.monotonic() - started:.0f} s)\n")
    print(f"{'check'.ljust(width)}  failures  what ran")
    print(f"{'-' * width}  --------  --------")
    for what, detail, n in rows:
        print(f"{what.ljust(width)}  {str(n).rjust(8)}  {detail}")
    print(f"{'-' * width}  --------")
    print(f"{'FAILURES (must be 0)'.ljust(width)}  {str(total).rjust(8)}")
    for f in failures[:30]:
        print(f"  - {f}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
