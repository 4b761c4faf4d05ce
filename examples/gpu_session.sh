#!/usr/bin/env bash
# One short GPU session, as a lent CUDA machine runs it: the benchmark and the call costs on
# the GPU, then the GPU checks, each part stopped at its own limit so that one slow part
# cannot hide the rest. The logs land in OUT (default ./gpu_out): 8 files on one GPU (two
# tables, gpu_check.txt, five logs), the device tool's limit.
#
#   bash examples/gpu_session.sh [OUT]      # from the repository root; about 9 to 10 minutes
#
# It runs on the machine's own python3 and packages (torch, jax with CUDA, flax), with the
# repository on PYTHONPATH: nothing is installed. XLA's GPU autotuning is off for the tests
# (their programs are small; compiling dominates), left on for the benchmark.
set -uo pipefail
OUT=${1:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
python3 -c "import sys, torch, jax, flax, numpy
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'jax', jax.__version__, 'flax', flax.__version__, 'numpy', numpy.__version__, jax.devices())" \
  2>&1
# The benchmark and the call costs first: the checks' tests passed on the last GPU, and
# these measure what no CPU can (LEAVES is left out: its first GPU compile outlasted 100 s).
timeout 110 python3 examples/bench/benchmark.py --device cuda --only tiny,medium,deep \
  --out /tmp/gpu_bench --docs "$OUT/benchmarks_cuda.md" 2>&1
echo "benchmark exit $?"
timeout 100 python3 examples/bench/call_costs.py --device cuda --docs "$OUT/call_costs_cuda.md" 2>&1
echo "call_costs exit $?"
XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" timeout 360 python3 examples/gpu_check.py \
  --log "$OUT/logs" --timeout 150 --skip leaves 2>&1 | tee "$OUT/gpu_check.txt"
echo "gpu_check exit $?"
