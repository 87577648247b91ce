#!/usr/bin/env bash
# The GEMV fold (issue 26, W2: RMSNorm and SiLU-and-multiply inside the small-batch
# projections) on one GPU machine, in one command: its GPU tests, the kernel
# microbenchmark (folded vs separate kernels, with a launch-parameter sweep) and W2 with
# the fold on and off, in two rounds (on, off, on, off; the model is written once).
#
#   OUT=results MODEL_ROOT=/dev/shm/lmkit-models bash bench/gemv_fold_ab.sh [tests] [kernels] [w2]
#
# With no step named, all three run (about 15 minutes; name steps to split it).
# PROFILE_STEPS (default 6) adds a kernel table of that many decode steps to each W2 run.
set -euo pipefail
out=${OUT:-gemv-fold}
root=${MODEL_ROOT:-/dev/shm/lmkit-models}
steps=${*:-tests kernels w2}
here=$(dirname "$0")
mkdir -p "$out"
for step in $steps; do
  case $step in
    tests)
      python3 -m pytest -q -s "$here/../tests/gpu/test_gemv_fold_gpu.py" | tee "$out/tests.log" ;;
    kernels)
      python3 "$here/gemv_fold.py" --rows 1,4,8 --sweep --out "$out/kernels.json" \
        | tee "$out/kernels.log" ;;
    w2)
      for round in 1 2; do
        python3 "$here/gpu_engine.py" --peer none --workloads W2 --model-root "$root" \
          --ab-env LMKIT_GEMV_FOLD=0 --profile-steps "${PROFILE_STEPS:-6}" \
          --out "$out/w2_round$round.json" | tee "$out/w2_round$round.log"
      done ;;
    *) echo "unknown step '$step'; choose from: tests kernels w2" >&2; exit 2 ;;
  esac
done
echo "results in $out/"
