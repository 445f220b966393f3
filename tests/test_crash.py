"""Tier 4: a writer killed with SIGKILL at random moments never leaves a broken region.

After every kill the region must open, each model's latest must verify and equal exactly the
state that was saved at its step, and no step whose future the child saw complete may be newer
than the latest (nothing reported durable is lost).
"""
import multiprocessing as mp
import os
import random
import signal
import time
import zlib

import pytest
import torch

import ckptfs
from conftest import assert_same, mp_context

KILLS = int(os.environ.get("CKPTFS_CRASH_KILLS", "250"))  # issue 4: a few hundred rounds in CI
MODELS = ("alpha", "beta")


def expected_state(model: str, step: int):
    g = torch.Generator().manual_seed(zlib.crc32(f"{model}:{step}".encode()))
    return {"model": {"w": torch.randn(96, 96, generator=g), "b": torch.full((300,), float(step))},
            "optim": {"step": step, "lr": 0.1 / (step + 1), "name": model}}


def _save_forever(region_path: str, start_step: int, report_path: str):
    # O_APPEND writes survive the kill; a line is written only after its save is durable.
    report_fd = os.open(report_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    store = ckptfs.Store(region_path)
    writers = {m: store.writer(m, max_inflight=2, chunk_bytes=16384, slots=4) for m in MODELS}
    step = start_step
    os.write(report_fd, b"ready\n")
    while True:
        futs = {m: w.save(expected_state(m, step), step=step) for m, w in writers.items()}
        for m, f in futs.items():
            f.add_done_callback(lambda f, m=m, s=step: f.exception() is None and
                                os.write(report_fd, f"{m} {s}\n".encode()))
        step += 1


@pytest.mark.crash
def test_sigkill_at_random_moments(region_path, store):
    ctx = mp_context()
    rng = random.Random(1234)
    durable: dict[str, int] = {}
    step = 0
    survived = 0
    for round_no in range(KILLS):
        report_path = f"{region_path}.report{round_no}"
        child = ctx.Process(target=_save_forever, args=(region_path, step, report_path))
        child.start()
        deadline = time.monotonic() + 60
        while not (os.path.exists(report_path) and open(report_path, "rb").read(6) == b"ready\n"):
            assert child.is_alive() and time.monotonic() < deadline, "the saving child failed to start"
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.2))  # kill at a random moment of the save loop
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        with open(report_path) as f:
            reported = f.read()
        for line in reported.split("\n")[1:]:
            if line:
                m, s = line.split()
                durable[m] = max(durable.get(m, -1), int(s))

        with ckptfs.Store(region_path) as s:  # a fresh open, as after a real crash
            for m in MODELS:
                if m not in s.models():
                    assert m not in durable
                    continue
                latest = s.latest(m)
                if latest is None:
                    assert m not in durable
                    continue
                assert latest.step >= durable.get(m, -1), f"round {round_no}: durable step lost for {m}"
                assert s.verify(m, latest.step) == []
                assert_same(expected_state(m, latest.step), s.load(m))
                step = max(step, latest.step + 1)
        step += 100  # next round's steps are distinct from anything half-written
        survived += 1
    assert survived == KILLS
    assert durable, "the child never completed a save: the kill window is too short to test anything"
