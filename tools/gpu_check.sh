#!/usr/bin/env bash
# The GPU checks of the whole project, on a machine with CUDA and a PyTorch that sees it:
#   bash tools/gpu_check.sh [build|open|test|quick|train|full] [OUTDIR]
# build: ckptfs._native built in place, nothing run (then run one tool with PYTHONPATH=/tmp/ckptfs-site:$PWD);
# open: the figures still open, most wanted first, each under a timeout that keeps the whole within
# one device call (under 10 minutes: give the call timeout_s=600): the GPT-2 training loop (ckptfs and the raw floor, 2 rounds), tests/test_gpu.py, bench_save's GPT-2 rows,
# bench_dist at W=1 (see tools/README.md, On a GPU machine);
# test: the build and tests/test_gpu.py alone; quick: + a short bench_save, emulator and real
# training loop; train: + the real GPT-2 small training loop (bench_train.py) alone; full: + every
# benchmark at full size, bench_dist.py with one rank per GPU among them (more than one device
# call's 10 minutes on an H200: run train apart).
# Builds ckptfs._native in place (no network needed: a C compiler and Python's headers), then runs
# tests/test_gpu.py, bench_save --device cuda and the training emulator on CUDA, each log to OUTDIR.
# Extra wheels (e.g. isal for a Python without it) may be put in $CKPTFS_WHEELS; zlib's headers,
# where the machine has none, in $CKPTFS_ZLIB_INCLUDE.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
OUTDIR=${2:-out/gpu}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}

if [ -n "${CKPTFS_WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/ckptfs-site "$CKPTFS_WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/ckptfs-site${PYTHONPATH:+:$PYTHONPATH}
fi
SUFFIX=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
PYINC=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
# the sources and flags of pyproject.toml's ext-module (read from there, so that a new source file
# is built here too); libz by soname, so that no -dev package is needed
read -r -a SOURCES <<<"$($PY -c 'import tomllib; m = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["ext-modules"][0]; print(" ".join(m["sources"]))')"
read -r -a CFLAGS <<<"$($PY -c 'import tomllib; m = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["ext-modules"][0]; print(" ".join(m["extra-compile-args"]))')"
${CC:-cc} "${CFLAGS[@]}" -shared -fPIC -I"$PYINC" ${CKPTFS_ZLIB_INCLUDE:+-I"$CKPTFS_ZLIB_INCLUDE"} \
    "${SOURCES[@]}" -o "ckptfs/_native$SUFFIX" -l:libz.so.1 -ldl || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
$PY -c 'import torch, ckptfs; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' | tee "$OUTDIR/env.txt"
[ "$MODE" = build ] && exit 0
if [ "$MODE" = open ]; then
    rc=0
    # the tests first: they hold what has never run on hardware
    timeout 85 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu.py -rs > "$OUTDIR/test_gpu.log" 2>&1 || rc=1
    tail -3 "$OUTDIR/test_gpu.log"
    # the peers dcp.async_save and torch.save cost ~100 s a round at f=1 (stop 38: +980 % and +1056 %):
    # here the checkpointer against the floor, at the f where the H100's disk keeps up (5) and where
    # not (1); each row ~20 s with its baseline loops (stop 42: f=1,2,5 x 2 rounds ran past 240 s)
    timeout 240 $PY tools/bench_train.py --device cuda --f 1,5 --methods ckptfs,raw --rounds 2 --json "$OUTDIR/bench_train.json" \
        > "$OUTDIR/bench_train.log" 2>&1 || rc=1
    tail -12 "$OUTDIR/bench_train.log"
    timeout 95 $PY tools/bench_save.py --device cuda --states gpt2 --repeat 3 --skip safetensors,dcp,dcp_async,extra \
        > "$OUTDIR/bench_save.log" 2>&1 || rc=1
    grep -A14 "^targets" "$OUTDIR/bench_save.log"
    timeout 140 $PY tools/bench_dist.py --device cuda --worlds 1 --rounds 3 > "$OUTDIR/bench_dist.log" 2>&1 || rc=1
    grep -v "loss_type" "$OUTDIR/bench_dist.log" | tail -22
    exit $rc
fi

rc=0
$PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu.py -rs 2>&1 | tee "$OUTDIR/test_gpu.log" || rc=1
if [ "$MODE" = test ]; then
    exit $rc
elif [ "$MODE" = quick ]; then
    $PY tools/bench_save.py --device cuda --quick --repeat 2 2>&1 | tee "$OUTDIR/bench_save.log" || rc=1
    $PY tools/train_emulator.py --device cuda --quick --mode overlap 2>&1 | tee "$OUTDIR/emulator.log" || rc=1
    $PY tools/bench_train.py --device cuda --layers 2 --width 256 --vocab 8192 --seq 256 --batch 4 --iters 10 \
        --f 1,5 --rounds 1 2>&1 | tee "$OUTDIR/bench_train.log" || rc=1
elif [ "$MODE" = train ]; then
    $PY tools/bench_train.py --device cuda --rounds 3 --json "$OUTDIR/bench_train.json" 2>&1 | tee "$OUTDIR/bench_train.log" || rc=1
else
    $PY tools/bench_save.py --device cuda --repeat 5 --json "$OUTDIR/bench_save.json" 2>&1 | tee "$OUTDIR/bench_save.log" || rc=1
    $PY tools/train_emulator.py --device cuda --mode overlap --f 1,2,5 --repeat 3 --json "$OUTDIR/emulator.json" 2>&1 | tee "$OUTDIR/emulator.log" || rc=1
    $PY tools/bench_train.py --device cuda --rounds 3 --json "$OUTDIR/bench_train.json" 2>&1 | tee "$OUTDIR/bench_train.log" || rc=1
    GPUS=$($PY -c 'import torch; print(min(4, torch.cuda.device_count()))')
    $PY tools/bench_dist.py --device cuda --worlds "$(seq -s, 1 "$GPUS")" --rounds 3 2>&1 | tee "$OUTDIR/bench_dist.log" || rc=1
fi
exit $rc
