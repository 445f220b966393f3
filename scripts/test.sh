#!/usr/bin/env bash
# Sets up a fresh machine and runs the whole test suite (what .ci/run calls); other arguments go to
# pytest. With the versions of the lock (requirements/constraints.txt), or with --latest the newest
# releases of the runtime and test dependencies (torch stays at requirements/torch.txt), to find
# upstream breaks on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
setup_args=() pytest_args=()
for arg in "$@"; do
    if [ "$arg" = --latest ]; then setup_args=(--latest); else pytest_args+=("$arg"); fi
done
bash scripts/setup.sh "${setup_args[@]}"
exec python3 -m pytest -q -p no:cacheprovider "${pytest_args[@]}"
