#!/usr/bin/env bash
# Installs everything ckptfs needs on a fresh Debian machine (idempotent; run as root or with sudo).
# Python packages at the versions of the lock, requirements/constraints.txt (known to pass the
# suite); with --latest at their newest releases instead, all but torch (see scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

LATEST=0
for arg in "$@"; do
    case "$arg" in
        --latest) LATEST=1 ;;
        *) echo "usage: bash scripts/setup.sh [--latest]" >&2; exit 2 ;;
    esac
done

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
# torch first, pinned (requirements/torch.txt) to the CPU build available locally, so that nothing
# pulls a CUDA build; every later install keeps it.
TORCH=$(grep -E '^torch==' requirements/torch.txt)
if ! $PY -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != sys.argv[1])' "${TORCH#torch==}" 2>/dev/null; then
    $PY -m pip install -q "$TORCH"
fi
if [ "$LATEST" = 1 ]; then
    # the newest release of every dependency (eager: theirs too), ignoring the lock; torch stays
    $PY -m pip install -q --upgrade --upgrade-strategy eager -c requirements/torch.txt -e ".[test]"
    # what now differs from the lock: where to look first when the suite fails
    $PY - <<'EOF'
import importlib.metadata as md, re
changed = []
for line in open("requirements/constraints.txt"):
    m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
    if m:
        try:
            now = md.version(m[1])
        except md.PackageNotFoundError:
            now = "absent"
        if now != m[2]:
            changed.append(f"{m[1]} {m[2]} -> {now}")
print("ckptfs setup: newer than the lock:", ", ".join(changed) or "nothing")
EOF
else
    $PY -m pip install -q -c requirements/constraints.txt -e ".[test]"
fi
$PY -c 'import ckptfs, ckptfs._native, pyfuse3, safetensors; print("ckptfs setup: ok")'
