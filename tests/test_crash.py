"""Tier 4: a writer killed with SIGKILL at random moments never leaves a broken region.

After every kill the region must open, each model's latest must verify and equal exactly the
state that was saved at its step, and no step whose future the child saw complete may be newer
than the latest (nothing reported durable is lost). The loop is ckptfs.testing.load.kill_rounds,
the same one tools/reliability.py runs for thousands of rounds.
"""
import os

import pytest

from ckptfs.testing.load import kill_rounds

pytestmark = [pytest.mark.slow]

KILLS = int(os.environ.get("CKPTFS_CRASH_KILLS", "250"))  # issue 4: a few hundred rounds in CI


@pytest.mark.crash
def test_sigkill_at_random_moments(region_path, store):
    report = kill_rounds(region_path, KILLS, seed=1234)
    assert report.failures == []
    assert report.survived == KILLS
    assert report.saves_confirmed > 0, "the child never completed a save: the kill window tests nothing"
