#!/usr/bin/env bash
# Sets up a fresh machine and runs the whole test suite (what .ci/run calls).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q -p no:cacheprovider "$@"
