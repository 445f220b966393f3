#!/usr/bin/env bash
# Installs everything ckptfs needs on a fresh Debian machine (idempotent; run as root or with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
# mount: losetup, for the tests of regions on a block device (a loop device)
APT_PACKAGES="fuse3 libfuse3-dev pkg-config libpmem-dev zlib1g-dev unzip mount"
missing=""
for p in $APT_PACKAGES; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "ckptfs setup: apt-get install$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

PY=${PYTHON:-python3}
# torch first, pinned to the CPU build available locally, so that nothing pulls a CUDA build.
if ! $PY -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[test]"
$PY -c 'import ckptfs, ckptfs._native, pyfuse3, safetensors; print("ckptfs setup: ok")'
