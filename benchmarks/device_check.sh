#!/usr/bin/env bash
# The accelerator checks of issues 35 and 44 in one run, for a lent GPU machine (device tool),
# within one call of at most 10 minutes (about 9 here, the rest for its start and transfers):
#   bash benchmarks/device_check.sh "$OUT"
# 1. the whole suite (pyproject's testpaths: tests, docstrings, README and docs pages) on the
#    JAX there, notebooks left out (they run on CPU in CI); 12 workers,
# 2. benchmark families lm (MFU, time to first step in fresh processes, both orders),
#    dispatch (host overhead of train_step on a tiny step) and first_step (issue 47: the
#    first step's split, functree against raw JAX in fresh processes, both orders) and
#    startup (issue 47: loading a saved model against from_pretrained, tiny and small),
# 3. host_ops --time (issue 47 item 4: the Python per call, the kernels of each compiled
#    step, and each step against its program alone and raw JAX's, interleaved), on the
#    dispatch family's MLP and on one of 200 parameter leaves (the cost that grows with them),
# 4. moe: ft.nn.SparseMoE's dense and sorted (ragged_dot) forms, whether "auto"'s dense
#    choice off the TPU holds on this GPU's XLA, and a decoding step's gathered form.
# Each part writes its own file under the output folder, so a timeout keeps what finished.
set -u
out="${1:-/tmp/device_check}"
mkdir -p "$out"
# JAX reserves 75% of the GPU's memory in every process by default: 12 workers (and their
# subprocesses) would each ask for it, and all but the first fail to allocate. Each process
# takes what it uses instead.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# functree from this checkout in every process, the suite's subprocesses included (the
# machine's copy of the tree is not installed).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c 'import jax, sys; print(jax.__version__, jax.devices(), sys.version)' > "$out/versions.txt" 2>&1
cat "$out/versions.txt"
timeout 285 python -m pytest -n 12 --dist loadfile -q \
    --ignore=tests/test_notebooks.py --maxfail=50 > "$out/suite.txt" 2>&1
echo "suite: exit $?"
tail -40 "$out/suite.txt"
timeout 215 python benchmarks/run.py --only lm,dispatch,first_step,startup --quick --out "$out/bench" > "$out/bench.txt" 2>&1
echo "benchmarks: exit $?"
tail -60 "$out/bench.txt"
timeout 45 python benchmarks/host_ops.py --time > "$out/host_ops.txt" 2>&1
echo "host_ops: exit $?"
cat "$out/host_ops.txt"
timeout 25 python benchmarks/host_ops.py --time --leaves 200 > "$out/host_ops_200.txt" 2>&1
echo "host_ops --leaves 200: exit $?"
cat "$out/host_ops_200.txt"
timeout 25 python benchmarks/moe.py --rounds 10 > "$out/moe.txt" 2>&1 && \
    timeout 15 python benchmarks/moe.py --rounds 10 --tokens 2 >> "$out/moe.txt" 2>&1
echo "moe: exit $?"
cat "$out/moe.txt"
