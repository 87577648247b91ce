#!/usr/bin/env bash
# lmkit beside vLLM (and HF transformers) on one GPU machine, in one command (issue 24):
# the offline workloads W1-W3 (bench/gpu_engine.py: lmkit, vLLM's engine, transformers'
# continuous batching on subsets) and online serving at several request rates
# (bench/serve_peers.py: `lmkit serve` and vLLM's OpenAI server, one client).
#
#   OUT=results MODEL_ROOT=$HOME/models bash bench/vllm_compare.sh
#
# vLLM must be importable (on the offline GPU machine: ../shared/gpu/vllm_bundle.sh, then
# PYTHONPATH=$HOME/vsite:...), and for its server the packages that docs/gpu.md lists.
# RATES (default 32,8,inf), PROMPTS (256) and HF_SUBSET (W1=32,W3=64) override the sizes;
# CLIENT_PROCS (default 1,4) is the serving client's process sweep; PROFILE=1 adds the
# whole-run profile of every workload on lmkit's and vLLM's side (--profile-run).
set -euo pipefail
out=${OUT:-vllm-compare}
root=${MODEL_ROOT:-$HOME/models}
mkdir -p "$out"
python3 -c "import vllm; print('vLLM', vllm.__version__)" || {
  echo "vllm is not importable: install it (or the bundle) first" >&2; exit 2; }
here=$(dirname "$0")
profile=()
[ "${PROFILE:-0}" = 1 ] && profile=(--profile-run)
python3 "$here/gpu_engine.py" --peer vllm,hf --hf-subset "${HF_SUBSET:-W1=32,W3=64}" \
  --workloads W1,W2,W3 --model-root "$root" "${profile[@]}" --out "$out/engine.json" \
  | tee "$out/engine.log"
python3 "$here/serve_peers.py" --sides lmkit,vllm --rates "${RATES:-32,8,inf}" \
  --num-prompts "${PROMPTS:-256}" --client-procs "${CLIENT_PROCS:-1,4}" \
  --model-root "$root" --log-dir "$out/serve" --out "$out/serve.json" | tee "$out/serve.log"
echo "results in $out/ (engine.json, serve.json)"
