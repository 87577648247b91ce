#!/usr/bin/env bash
# The flash_attn attention backend on a GPU machine, in one command (issue 18):
#
#   bash bench/gpu_check_flash_attn.sh [STAGE ...]      # default: tests engine k
#
# Stages (each writes its log or JSON under $OUT/fa_check, else /tmp/fa_check):
#   tests   `lmkit plugins list`'s flash_attn line, the attention backend comparisons
#           against the torch reference, and the conformance suite (every property,
#           CUDA graphs included), for flash_attn
#   engine  the engine's teacher-forced agreement with transformers (SmolLM2-135M via
#           LMKIT_TEST_SMOLLM2, and the Llama-8B-shaped model), graphs on and off
#   k       benchmark K (decode attention, 64 x 4096, Llama-8B heads) for triton,
#           flashinfer and flash_attn in one run (flash_attn also on 128-token blocks)
#   w       W1, W2, W3 (bench/gpu_engine.py, no peer) once per backend: triton,
#           flashinfer, flash_attn (minutes each; W_BACKENDS="a b" picks some; the
#           random models are kept in MODEL_ROOT, default ~/models, and reused)
#
# Before: install FlashAttention-4 as .gpu/fa4/INSTALL.md says (into $HOME/fa4site, which
# this script puts on PYTHONPATH with the cutlass-dsl path its .pth file would add), and
# lmkit with its entry points (.gpu/install.sh, .gpu/env.sh). FA4 compiles kernels on first
# use; they are kept in $HOME/fa4cache across processes, so a second run is faster.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}/fa_check
site=${FA4_SITE:-$HOME/fa4site}
if [ -d "$site" ]; then
  export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}"
fi
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$HOME/fa4cache}
export PYTHONUNBUFFERED=1
mkdir -p "$out" "$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests engine k)
status=0

step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

for stage in "${stages[@]}"; do
  case $stage in
    tests)
      $py -m lmkit.cli.main plugins list | grep -E "^ *flash_attn" | tee "$out/plugins_list.txt"
      step tests_backends $py -m pytest -q -rs -k flash_attn tests/gpu/test_attention_backends_gpu.py
      step tests_conformance $py -m pytest -q -rs -k "flash_attn" \
        tests/unit/test_conformance_attention.py::test_gpu_backends_pass_including_cuda_graph_replay
      ;;
    engine)
      step engine $py -m pytest -q -rs -k flash_attn tests/gpu/test_engine_gpu.py
      ;;
    k)
      step k $py bench/attention_decode.py --num-seqs 64 --context 4096 \
        --backends triton,flashinfer,flash_attn --out "$out/k.json"
      ;;
    w)
      for backend in ${W_BACKENDS:-triton flashinfer flash_attn}; do
        step "w_$backend" $py bench/gpu_engine.py --peer none --attention "$backend" \
          --model-root "${MODEL_ROOT:-$HOME/models}" --out "$out/w_$backend.json"
      done
      ;;
    *)
      echo "unknown stage '$stage' (tests, engine, k, w)" >&2
      exit 2
      ;;
  esac
done
echo "results in $out (exit $status)"
exit $status
