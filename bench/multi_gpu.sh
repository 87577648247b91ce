#!/usr/bin/env bash
# Issue 21's measurements on one host with two or more GPUs, in one command, most
# important first, each step bounded by what is left of LIMIT seconds (default 570):
#   1. the multi-GPU tests (tests/gpu/test_parallel*_gpu.py: TP=2 over NCCL against TP=1,
#      CUDA graphs, ngram and structured output under TP=2; SmolLM2 and the Llama-8B shape
#      at TP=2 through mp and ray: set LMKIT_TEST_SMOLLM2 to the GGUF, install Ray);
#   2. W6 and W7 on the Llama-3.1-70B shape at TP=2 with random weights drawn by the
#      engine (--load-format dummy: 141 GB of weights, nothing written);
#   3. W3 (Llama-3.1-8B shape) at TP=1, TP=2 and DP=2 (bench/gpu_engine.py --dp 2);
#   4. data parallel serving: bench/dp_serve.py --dp 1,2 (Qwen3-0.6B shape).
# Results go to OUT (default ./multi_gpu_out), one log and JSON per step.
#
#   LIMIT=570 OUT=/tmp/mg bash bench/multi_gpu.sh
set -u
cd "$(dirname "$0")/.."
LIMIT=${LIMIT:-570}
OUT=${OUT:-multi_gpu_out}
ROOT=${MODEL_ROOT:-/dev/shm/lmkit-models}
mkdir -p "$OUT" "$ROOT"
start=$(date +%s)
left() { echo $(( LIMIT - 15 - ($(date +%s) - start) )); }
step() {  # step NAME MIN_SECONDS COMMAND...: run it within what is left, log it
  local name=$1 need=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt "$need" ]; then echo "$name: skipped ($l s left)"; return; fi
  local t0; t0=$(date +%s)
  timeout "$l" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - t0 )) s"
}
nvidia-smi -L
step tests 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_parallel_gpu.py \
  tests/gpu/test_parallel_features_gpu.py tests/gpu/test_parallel_models_gpu.py
tail -3 "$OUT/tests.log" 2>/dev/null
step w67_tp2 150 python3 bench/gpu_engine.py --workloads W6,W7 --peer none --attention triton \
  --tp 2 --load-format dummy --model-root "$ROOT" --out "$OUT/w67_tp2.json"
grep -A3 "lmkit tok/s" "$OUT/w67_tp2.log" 2>/dev/null
# W3 at TP=1, TP=2 and DP=2 (two engine processes, one GPU each), one model written once
for tp in 1 2; do
  step "w3_tp$tp" 90 python3 bench/gpu_engine.py --workloads W3 --peer none --attention triton \
    --tp $tp --model-root "$ROOT" --out "$OUT/w3_tp$tp.json"
  grep -A2 "lmkit tok/s" "$OUT/w3_tp$tp.log" 2>/dev/null
done
step w3_dp2 90 python3 bench/gpu_engine.py --workloads W3 --peer none --attention triton \
  --dp 2 --model-root "$ROOT" --out "$OUT/w3_dp2.json"
grep -A2 "lmkit tok/s" "$OUT/w3_dp2.log" 2>/dev/null
# data parallel serving (Qwen3-0.6B shape): the servers of dp_serve.py run at once, each on
# its own devices: 3 GPUs for --dp 1,2; on 2, one size after the other (not interleaved)
if [ "$(nvidia-smi -L | wc -l)" -ge 3 ]; then
  step dp 120 python3 bench/dp_serve.py --dp 1,2 --rates 16,64 --rounds 1 --num-prompts 256 \
    --gpus 0,1,2 --out "$OUT/dp.json"
  tail -8 "$OUT/dp.log" 2>/dev/null
else
  for dp in 1 2; do
    step "dp$dp" 90 python3 bench/dp_serve.py --dp $dp --rates 16,64 --rounds 1 \
      --num-prompts 256 --gpus "$(seq -s, 0 $((dp - 1)))" --out "$OUT/dp$dp.json"
    tail -6 "$OUT/dp$dp.log" 2>/dev/null
  done
fi
