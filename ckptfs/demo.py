"""The main job: a short real training loop that checkpoints into the default region, browsed
through the mount with ordinary tools.

    python -m ckptfs.demo [--region PATH] [--mountpoint DIR] [--steps N] [--every K]

Formats the default region if absent, mounts it, trains a small transformer with AdamW,
checkpointing every K steps with two checkpoints in flight, then lists the mount, loads
``latest/checkpoint.pt`` with torch.load, exports ``model.safetensors`` with cp, and unmounts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import ckptfs
from ckptfs.fs.daemon import cli_argv

MODEL_NAME = "demo-transformer"


class TinyLM(torch.nn.Module):
    """A two-layer transformer language model over a 256-symbol vocabulary."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, dropout=0.0)
        self.blocks = torch.nn.TransformerEncoder(block, layers)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


def show(title: str, text: str) -> None:
    print(f"\n$ {title}\n{text.rstrip()}")


def train(store: ckptfs.Store, steps: int, every: int) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = torch.tensor(list(b"ckptfs makes checkpoints nearly free and easy to share. " * 64))
    with store.writer(MODEL_NAME, max_inflight=2) as writer:
        for step in range(1, steps + 1):
            start = torch.randint(0, len(text) - 33, (8,))
            batch = torch.stack([text[s:s + 33] for s in start])
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            writer.wait_snapshot()  # the previous snapshot must be taken before weights change
            opt.step()
            if step % every == 0:
                writer.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                             "loss": loss.item()}, step=step, async_snapshot=True)
                print(f"step {step:4d}  loss {loss.item():.3f}  checkpoint queued")
    print(f"all checkpoints committed; versions kept: {[v.step for v in store.versions(MODEL_NAME)]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--region", help="region path (default: $CKPTFS_REGION or the per-user default)")
    parser.add_argument("--mountpoint", help="where to mount (default: a new temporary directory)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args(argv)

    store = ckptfs.Store(args.region)
    print(f"region: {store.path} ({store.status()['region_bytes'] >> 30} GiB, sparse)")
    mountpoint = args.mountpoint or tempfile.mkdtemp(prefix="ckptfs-demo-")
    os.makedirs(mountpoint, exist_ok=True)
    cli = cli_argv()
    run(cli + ["mount", "--region", store.path, mountpoint])
    export_dir = tempfile.mkdtemp(prefix="ckptfs-export-")
    try:
        train(store, args.steps, args.every)
        time.sleep(1.0)  # the mount refreshes its listing within a second
        model_dir = os.path.join(mountpoint, MODEL_NAME)
        show(f"ls -l {model_dir}", run(["ls", "-l", model_dir]))
        latest = os.path.join(model_dir, "latest")
        show(f"ls -l {latest}/", run(["ls", "-l", latest + "/"]))
        obj = torch.load(os.path.join(latest, "checkpoint.pt"), weights_only=True)
        same = all(torch.equal(obj["model"][k], v) for k, v in store.load(MODEL_NAME)["model"].items())
        show(f"python -c 'torch.load(\"{latest}/checkpoint.pt\", weights_only=True)'",
             f"step {obj['step']}, loss {obj['loss']:.3f}, {len(obj['model'])} model tensors, "
             f"optimizer state for {len(obj['optim']['state'])} parameters; equal to Store.load: {same}")
        dest = os.path.join(export_dir, "model.safetensors")
        run(["cp", os.path.join(latest, "model.safetensors"), dest])
        from safetensors.torch import load_file
        weights = load_file(dest)
        show(f"cp {latest}/model.safetensors {dest}",
             f"{os.path.getsize(dest)} bytes, {len(weights)} tensors, opens with safetensors.load_file")
        show(f"ckptfs ls --region {store.path} {MODEL_NAME}", run(cli + ["ls", "--region", store.path, MODEL_NAME]))
        if not same:
            print("ERROR: the mounted checkpoint differs from Store.load", file=sys.stderr)
            return 1
    finally:
        subprocess.run(cli + ["umount", mountpoint], check=False)
        shutil.rmtree(export_dir, ignore_errors=True)
        if not args.mountpoint:
            try:
                os.rmdir(mountpoint)
            except OSError:
                pass
        store.close()
    print("\ndemo finished: mounted, browsed, loaded, exported, unmounted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
