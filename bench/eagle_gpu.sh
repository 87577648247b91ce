#!/usr/bin/env bash
# Issue 17's measurement on one GPU machine, in one command: train an EAGLE-3 head for
# the default model (SmolLM2-135M-Instruct, GGUF) with `lmkit spec train-eagle` on a
# prompt set disjoint from the benchmark's (SOURCE=tasks: bench/eagle_train_prompts.py's everyday
# tasks first, `--tasks`; self: SELF_PROMPTS prompts the model writes itself, `lmkit spec
# write-prompts`; both, the default: the two sets together), then time the chat workload at batch 1 and
# 32 with no speculation beside eagle3 (the new head) and beside ngram, each pair in one
# process (bench/spec_decode.py), and print the head's held-out accuracy.
#
#   GGUF=path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=results bash bench/eagle_gpu.sh [train] [fit] [bench]
#
# The prompt set is written once ($OUT/prompts.jsonl; delete it to write another).
# FEATURES=disk FEATURE_GB=N set the feature cache (train-eagle's --feature-cache, -gb).
# PROMPTS (task prompts, default 4000), SELF_PROMPTS (16000), STEPS (default 10000:
# session 42's 1.45x head; 5000 accepted 5% fewer tokens a step), BATCH (32), LR (1e-3), VOCAB (8192),
# ANSWER (max new tokens per training answer, 128), K (draft tokens, 3) and ATTN
# (triton) set the run. Bench runs, each beside plain decoding: eagle3, ngram, eagle3-off
# (speculation off above OFF_ABOVE requests, default 16: batch 32 decodes plainly, run
# ahead, the head catching up), eagle3-drop (the same with the head skipping requests that
# ran above it: speculative.catch_up_when_off false) and eagle3-adaptive
# (speculative.adaptive: drafts only while they measure faster). OFF_ABOVE=none skips the
# off and drop runs, ADAPTIVE=0 the adaptive one; RUNS (e.g. "eagle3-adaptive eagle3")
# names the runs outright; eagle3-tree (only when named) drafts the tree TREE (JSON rank
# paths, speculative.tree), by default the first one the fit step wrote. The fit step
# fits draft trees to the head (`lmkit spec fit-tree`) on the FIT_PROMPTS (80) task
# prompts after the first PROMPTS (held out from training): one tree of each size in
# TREE_NODES (default "8 16"), at most TREE_DEPTH (3) deep, in $OUT/tree<N>.json. HEAD (default $OUT/head) reuses or resumes a head; DEVICE=cpu
# DTYPE=float32 ATTN=auto runs it on the CPU (a smoke run: small PROMPTS and STEPS). With
# no step named both run (training ~16 minutes on an H200 at the defaults: prompts,
# answers and features ~7, 10000 steps ~9 at 51 s per 1000; SOURCE=tasks PROMPTS=4000
# saves the ~3 minutes of prompts the model writes).
set -euo pipefail
out=${OUT:-eagle-gpu}
gguf=${GGUF:?set GGUF to the SmolLM2-135M-Instruct GGUF file}
head=${HEAD:-$out/head}
steps=${*:-train bench}
here=$(dirname "$0")
mkdir -p "$out"
for step in $steps; do
  case $step in
    train)
      src=${SOURCE:-both}
      case $src in tasks|self|both) ;; *) echo "SOURCE=$src: use tasks, self or both" >&2; exit 2 ;; esac
      if [[ ! -s $out/prompts.jsonl ]]; then
        [[ $src != self ]] && python3 "$here/eagle_train_prompts.py" "$out/tasks.jsonl" --count "${PROMPTS:-4000}" --tasks
        [[ $src != tasks ]] && lmkit spec write-prompts "$gguf" --out "$out/self.jsonl" \
          --count "${SELF_PROMPTS:-16000}" --device "${DEVICE:-cuda}" --seed "${SEED:-0}"
        cat $( [[ $src != self ]] && echo "$out/tasks.jsonl" ) $( [[ $src != tasks ]] && echo "$out/self.jsonl" ) \
          > "$out/prompts.jsonl"
      fi
      lmkit spec train-eagle "$gguf" --out "$head" --device "${DEVICE:-cuda}" --prompts "$out/prompts.jsonl" \
        --max-steps "${STEPS:-10000}" --batch-size "${BATCH:-32}" --lr "${LR:-1e-3}" \
        --lr-schedule cosine --warmup-steps 100 --max-new-tokens "${ANSWER:-128}" \
        --draft-vocab-size "${VOCAB:-8192}" --feature-batch 64 --save-every 1000 --eval-prompts bench \
        --feature-cache "${FEATURES:-memory}" --feature-cache-gb "${FEATURE_GB:-8}" \
        2>&1 | tee "$out/train.log"
      cp "$head/eval.json" "$out/eval.json" ;;
    fit)
      n_fit=${FIT_PROMPTS:-80}
      python3 "$here/eagle_train_prompts.py" "$out/fit_all.jsonl" --tasks \
        --count $(( ${PROMPTS:-4000} + n_fit ))
      tail -n "$n_fit" "$out/fit_all.jsonl" > "$out/fit.jsonl"
      for nodes in ${TREE_NODES:-8 16}; do
        lmkit spec fit-tree "$gguf" --speculative-model "$head" --nodes "$nodes" \
          --depth "${TREE_DEPTH:-3}" --prompts "$out/fit.jsonl" --count "$n_fit" \
          --device "${DEVICE:-cuda}" --out "$out/tree$nodes.json" 2>&1 | tee "$out/fit$nodes.log"
      done ;;
    bench)
      off=${OFF_ABOVE:-16}
      runs=(eagle3 ngram)
      [[ $off != none ]] && runs+=(eagle3-off eagle3-drop)
      [[ ${ADAPTIVE:-1} == 1 ]] && runs+=(eagle3-adaptive)
      [[ -n ${RUNS:-} ]] && read -r -a runs <<< "$RUNS"
      for run in "${runs[@]}"; do
        case $run in eagle3|ngram|eagle3-off|eagle3-drop|eagle3-adaptive|eagle3-tree) ;;
          *) echo "unknown run '$run'; choose from: eagle3 ngram eagle3-off eagle3-drop eagle3-adaptive eagle3-tree" >&2; exit 2 ;;
        esac
        proposer=${run%%-*}
        extra=()
        [[ $proposer == eagle3 ]] && extra=(--speculative-model "$head")
        [[ $run == *-off || $run == *-drop ]] && extra+=(--disable-by-batch-size "$off")
        [[ $run == *-drop ]] && extra+=(--no-catch-up)
        [[ $run == *-adaptive ]] && extra+=(--adaptive)
        if [[ $run == *-tree ]]; then
          tree=${TREE:-}
          first=$out/tree$(set -- ${TREE_NODES:-8 16}; echo "$1").json
          [[ -z $tree && -s $first ]] && tree=$(cat "$first")
          extra+=(--spec-tree "${tree:?set TREE (JSON rank paths) or run the fit step first}")
        fi
        python3 "$here/spec_decode.py" --model "$gguf" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" \
          --attention "${ATTN:-triton}" --proposer "$proposer" "${extra[@]}" \
          --workloads chat --batches 1 32 --batch1-prompts 8 --chat-output-len 128 --stop-at-eos \
          --spec-tokens "${K:-3}" --repeats 2 --out "$out/spec_$run.json" \
          | tee "$out/spec_$run.log"
      done ;;
    *) echo "unknown step '$step'; choose from: train fit bench" >&2; exit 2 ;;
  esac
done
echo "results in $out/"
