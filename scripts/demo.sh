#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job: the demo on the default region.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m ckptfs.demo "$@"
