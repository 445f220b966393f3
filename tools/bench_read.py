"""Read path of the mount against plain files holding the same bytes, measured side by side.

    python tools/bench_read.py                 # 2 GiB checkpoint, 3 rounds
    python tools/bench_read.py --quick         # 256 MiB, 2 rounds (smoke run)
    python tools/bench_read.py --size-gib 4 --rounds 5 --json out/bench_read.json

Set-up: a region with one model holding ``{"model": <flat fp32 state of --size-gib>, "step": 1}``
(``_bench_common.make_flat_state``: ~100 tensors, random values), mounted with ``ckptfs mount``
(a real kernel mount; run as root). The plain peers are ``cp`` copies of the mounted
``state.safetensors`` and ``checkpoint.pt`` onto the same filesystem as the region, so both
sides read the same bytes from the same disk.

Each round times, alternating which side goes first:

| row | what is timed |
| --- | --- |
| cp cold | ``sync; echo 3 > drop_caches``, then ``cp FILE /dev/null`` (mount: state.safetensors) |
| cp warm | the same right after an untimed ``cp`` of that file (page cache filled) |
| torch.load cold | drop caches, ``torch.load(checkpoint.pt, weights_only=True)`` in a fresh process |
| torch.load warm | the same after an untimed load (info) |

Targets (DESIGN.md): ``cp`` from the mount >= 0.8x the plain file's throughput (ratio = plain
time / mount time), cold and warm; ``torch.load`` from the mount <= 1.25x the time of the plain
file (ratio = mount time / plain time). Ratios are per round, the table shows their median.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import GB, GiB, MiB, drop_caches, make_flat_state  # noqa: E402

MODEL = "bench"
LOAD_SCRIPT = ("import sys, time, torch\n"
               "t = time.perf_counter(); torch.load(sys.argv[1], weights_only=True)\n"
               "print(time.perf_counter() - t)\n")


def timed_cp(path: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cp", path, "/dev/null"], check=True)
    return time.perf_counter() - t0


def timed_load(path: str) -> float:
    """torch.load in a fresh process (import cost excluded: timed inside the child)."""
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, path], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def build(workdir: str, size: int) -> str:
    import ckptfs

    region = os.path.join(workdir, "bench.region")
    with ckptfs.Store.create(region, size_bytes=int(size * 2.4) + (256 << 20)) as store:
        with store.writer(MODEL, max_inflight=1, slots=2) as w:
            w.save({"model": make_flat_state(size), "step": 1}, 1).result()
    return region


def mount(region: str, mnt: str) -> subprocess.Popen:
    os.makedirs(mnt, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs.cli", "mount", "--foreground", "--region", region, mnt],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not os.path.ismount(mnt):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"bench_read: the mount did not come up: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    return proc


def unmount(proc: subprocess.Popen, mnt: str) -> None:
    subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
        proc.kill()
        proc.wait()


def measure(pairs: dict[str, tuple[str, str]], rounds: int, cold_ok: bool) -> dict:
    """{row: {"mount": [s...], "plain": [s...]}} for every row, ``rounds`` times."""
    samples: dict[str, dict[str, list[float]]] = {}
    rows = [("cp cold", "cp", True), ("cp warm", "cp", False),
            ("torch.load cold", "load", True), ("torch.load warm", "load", False)]
    for r in range(rounds):
        for row, kind, cold in rows:
            paths = pairs[kind]
            order = ("mount", "plain") if r % 2 == 0 else ("plain", "mount")
            for side in order:
                path = paths[0] if side == "mount" else paths[1]
                fn = timed_cp if kind == "cp" else timed_load
                if cold:
                    drop_caches()
                else:
                    fn(path)
                samples.setdefault(row, {"mount": [], "plain": []})[side].append(fn(path))
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr)
    return samples


def report(samples: dict, nbytes: dict[str, int], cold_ok: bool) -> dict:
    targets = {"cp cold": (">=", 0.8), "cp warm": (">=", 0.8), "torch.load cold": ("<=", 1.25),
               "torch.load warm": ("<=", 1.25)}
    out = {}
    print(f"\n{'row':<16} {'mount s':>9} {'plain s':>9} {'mount GB/s':>11} {'plain GB/s':>11} "
          f"{'ratio':>7} {'target':>8}  verdict")
    for row, s in samples.items():
        kind = "cp" if row.startswith("cp") else "load"
        m, p = statistics.median(s["mount"]), statistics.median(s["plain"])
        # cp: throughput ratio (plain time / mount time); torch.load: time ratio (mount / plain)
        per_round = [(pp / mm if kind == "cp" else mm / pp) for mm, pp in zip(s["mount"], s["plain"])]
        ratio = statistics.median(per_round)
        op, goal = targets[row]
        ok = ratio >= goal if op == ">=" else ratio <= goal
        verdict = "ok" if ok else "MISSED"
        if row.endswith("cold") and not cold_ok:
            verdict += " (caches not dropped: not cold)"
        print(f"{row:<16} {m:>9.3f} {p:>9.3f} {nbytes[kind] / m / GB:>11.2f} {nbytes[kind] / p / GB:>11.2f} "
              f"{ratio:>7.2f} {op + str(goal):>8}  {verdict}")
        out[row] = {"mount_s": s["mount"], "plain_s": s["plain"], "ratios": per_round, "ratio": ratio,
                    "target": f"{op} {goal}", "ok": ok}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 2 rounds")
    ap.add_argument("--dir", default="/tmp/ckptfs-bench", help="where the region and plain files go")
    ap.add_argument("--json", help="write every sample and ratio here")
    args = ap.parse_args()
    size = 256 * MiB if args.quick else int(args.size_gib * GiB)
    rounds = 2 if args.quick else args.rounds
    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_read-", dir=args.dir)
    mnt = os.path.join(workdir, "mnt")
    proc = None
    try:
        print(f"bench_read: {size / GiB:.2f} GiB checkpoint in {workdir}; load average {os.getloadavg()[0]:.2f}",
              file=sys.stderr)
        region = build(workdir, size)
        proc = mount(region, mnt)
        version = os.path.join(mnt, MODEL, "latest")
        pairs = {"cp": (os.path.join(version, "state.safetensors"), os.path.join(workdir, "plain.safetensors")),
                 "load": (os.path.join(version, "checkpoint.pt"), os.path.join(workdir, "plain.pt"))}
        for mounted, plain in pairs.values():
            shutil.copyfile(mounted, plain)
        os.sync()
        nbytes = {k: os.path.getsize(v[1]) for k, v in pairs.items()}
        cold_ok = drop_caches()
        if not cold_ok:
            print("bench_read: cannot drop the page cache (not root?): cold rows are warm", file=sys.stderr)
        samples = measure(pairs, rounds, cold_ok)
        result = report(samples, nbytes, cold_ok)
        print(f"\nstate.safetensors {nbytes['cp'] / GiB:.2f} GiB, checkpoint.pt {nbytes['load'] / GiB:.2f} GiB; "
              f"{rounds} rounds, medians; load average now {os.getloadavg()[0]:.2f}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"size_bytes": size, "rounds": rounds, "files_bytes": nbytes, "rows": result,
                           "loadavg": os.getloadavg()}, f, indent=1)
    finally:
        if proc is not None:
            unmount(proc, mnt)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
