"""The benchmarks in tools/ still run end to end on a tiny state, so they do not rot between the
runs by hand that produce the figures. No timing is asserted here (speed is the benchmarks'
business, not CI's): only that every method ran, every ratio was computed and ckptfs read back
what it saved."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow]

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def run_tool(name: str, *args: str, timeout_s: float = 120) -> None:
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, name), *args], capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_bench_save_runs_every_method_and_ratio(tmp_path):
    out = tmp_path / "save.json"
    run_tool("bench_save.py", "--quick", "--states", "gpt2", "--repeat", "2", "--dir", str(tmp_path / "b"),
             "--json", str(out))
    state = json.loads(out.read_text())["states"]["gpt2"]
    rows = state["rows"]
    for key in ("raw_write", "raw_read", "raw_overwrite", "memcpy", "memcpy_moment", "ckptfs_stall",
                "ckptfs_durable", "ckptfs_load", "ckptfs_load_into", "ckptfs_b2b", "raw_overwrite_b2b", "torch_save",
                "safetensors", "dcp_save", "raw_read_slot", "ckptfs_async_snapshot"):
        assert key in rows and rows[key]["median_s"] > 0, key
    assert rows["ckptfs_load"].get("verified") == [True]  # checked in the first round
    figures = {t["figure"]: t for t in state["targets"]}
    assert set(figures) == {"durable throughput / raw O_DIRECT overwrite", "back-to-back, aggregate / raw overwrite",
                            "back-to-back, aggregate / raw overwrite of one state",
                            "durable throughput / raw write of a new file", "durable throughput / torch.save+fsync",
                            "stall / memcpy beside it", "stall / warm memcpy (best case)",
                            "background snapshot (async_snapshot) / memcpy beside the save",
                            "Store.load / raw O_DIRECT read", "Store.load(into=) / raw O_DIRECT read",
                            "Store.load / raw O_DIRECT read of its own blocks, beside it",
                            "Store.load / raw O_DIRECT read into fresh memory",
                            "first save's stall (after prepare) / steady", "first save's stall without prepare / steady"}
    for figure, t in figures.items():
        # first saves: one without prepare, three new writers' after it (each against the rounds'
        # median); the others paired within each round
        rounds = {"first save's stall without prepare / steady": 1,
                  "first save's stall (after prepare) / steady": 3}.get(figure, 2)
        assert len(t["ratios"]) == rounds and t["ratio"] > 0, t
    assert any("first save into the fresh sparse region" in n for n in state["notes"]), state["notes"]
    assert not os.listdir(tmp_path / "b"), "bench_save left files behind"


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_train_emulator_runs_and_verifies(tmp_path, mode):
    out = tmp_path / "emu.json"
    run_tool("train_emulator.py", "--mode", mode, "--state-mib", "8", "--tensors", "4", "--t", "0.005",
             "--iters", "4", "--f", "1,2", "--n", "1,2", "--calib", "1", "--dir", str(tmp_path / "e"),
             "--json", str(out))
    result = json.loads(out.read_text())
    runs = result["runs"]
    # every configuration by ckptfs and by the raw floor it is compared with
    assert sorted((r["system"], r["N"], r["f"]) for r in runs) == [
        (system, n, f) for system in ("ckptfs", "raw") for n in (1, 2) for f in (1, 2)]
    for r in runs:
        assert "failed" not in r and not r["errors"], r
        assert r["verified"] is True and r["checkpoints"] == 4 // r["f"]
    rows = result["summary"][mode]["rows"]
    assert len(rows) == 4
    assert all("overhead" in r and "pred" in r and r["floor"] is not None for r in rows)
    # ckptfs's own share: paired with the raw floor of the same round (one round here)
    overhead = {(r["system"], r["N"], r["f"]): r["overhead"] for r in runs}
    for r in rows:
        assert r["own_runs"] == [overhead["ckptfs", r["N"], r["f"]] - overhead["raw", r["N"], r["f"]]]
        assert r["own"] == r["own_runs"][0]
    assert not os.listdir(tmp_path / "e"), "train_emulator left files behind"


def test_bench_train_runs_every_method_in_a_real_loop(tmp_path):
    out = tmp_path / "train.json"
    run_tool("bench_train.py", "--layers", "1", "--width", "64", "--vocab", "1000", "--seq", "32", "--batch", "2",
             "--iters", "4", "--f", "1,2", "--rounds", "2", "--dir", str(tmp_path / "t"), "--json", str(out))
    result = json.loads(out.read_text())
    rows = result["rows"]
    # every method at every f in every round, each between two loops without checkpoints
    assert sorted((r["method"], r["f"]) for r in rows) == sorted(
        (m, f) for m in ("ckptfs", "raw", "dcp_async", "torch_save") for f in (1, 2) for _ in range(2))
    assert all(r["base_s"] > 0 and r["loop_s"] > 0 for r in rows)
    assert [r["verified"] for r in rows if r["method"] == "ckptfs"] == [True] * 4  # the last save, loaded back
    for line in result["summary"]:
        ours = [r["overhead"] for r in rows if r["method"] == "ckptfs" and r["f"] == line["f"]]
        raw = [r["overhead"] for r in rows if r["method"] == "raw" and r["f"] == line["f"]]
        assert line["own_runs"] == [c - r for c, r in zip(ours, raw)]  # paired within each round
        # the disk keeps up where neither one save's latency (N = 2 hide it) nor the sustained rate
        # of saves back to back exceeds the interval
        t = line["f"] * result["t_iter_s"]
        assert result["tb_s"] > 0
        assert line["keeps_up"] == (result["tw_s"] <= 2 * t and result["tb_s"] <= t)
    assert not os.listdir(tmp_path / "t"), "bench_train left files behind"


def test_bench_dist_runs_every_method_at_each_world_size(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "bench_dist.py"), "--worlds", "1,2", "--layers", "1",
                           "--width", "64", "--rounds", "1", "--warmup", "0", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for world in (1, 2):
        assert f"W={world}:" in proc.stdout
    for figure in ("ckptfs writer stall / copy floor", "global commit after the last part, ms",
                   "raw O_DIRECT overwrite (the faster) / ckptfs writer durable", "dcp.save FileSystemWriter / dcp.save ckptfs",
                   "dcp.async_save FS / dcp.async_save ckptfs", "load of the W=2 checkpoint at W=1 (resharded)",
                   "(the disk's floor) / ckptfs StorageReader"):
        assert figure in proc.stdout, figure
    assert not os.listdir(tmp_path)  # its work directory is gone
