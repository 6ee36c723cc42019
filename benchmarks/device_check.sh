#!/usr/bin/env bash
# The accelerator checks of issue 35 in one run, for a lent GPU machine (device tool):
#   bash benchmarks/device_check.sh "$OUT"
# 1. the whole suite on the newest JAX there (notebooks left out: they run on CPU in CI),
# 2. benchmark families lm (MFU, time to first step in fresh processes, both orders),
#    dispatch (host overhead of train_step on a tiny step) and generate.
# Each part writes its own file under the output folder, so a timeout keeps what finished.
set -u
out="${1:-/tmp/device_check}"
mkdir -p "$out"
python -c 'import jax, sys; print(jax.__version__, jax.devices(), sys.version)' > "$out/versions.txt" 2>&1
timeout 280 python -m pytest -n 12 -q -p no:cacheprovider -o addopts="-p no:cacheprovider" \
    tests --ignore=tests/test_notebooks.py --maxfail=50 > "$out/suite.txt" 2>&1
tail -40 "$out/suite.txt"
timeout 240 python benchmarks/run.py --only lm,dispatch --quick --out "$out/bench" > "$out/bench.txt" 2>&1
tail -60 "$out/bench.txt"
