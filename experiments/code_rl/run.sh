#!/usr/bin/env bash
# The pre-registered runs of README.md (beside this file): code-eval of the base model, then per seed a GRPO run
# (ppo.mode=code) and a DPO run (dpo.mine_code) from the base model, and code-eval of both adapters. Outputs under
# $OUT (default runs/code_rl, not in git), each command's wall seconds in $OUT/<name>.wall.json; collect.py turns
# them into results.json. A finished step is skipped when the script runs again; a killed training resumes from
# its checkpoint. One torch thread per process: on the shared 2-core machine it was 3x faster than two.
set -euo pipefail
cd "$(dirname "$0")/../.."
ICRL=${ICRL:-.venv/bin/icrl}
OUT=${OUT:-runs/code_rl}
SEEDS=${SEEDS:-0}
export OMP_NUM_THREADS=1
CONFIG=(-c experiments/code_rl/code_rl.yaml)
mkdir -p "$OUT"

timed() {  # timed NAME COMMAND...: run once, record its wall seconds
  local name=$1
  shift
  [ -e "$OUT/$name.wall.json" ] && return 0
  local started
  started=$(date +%s)
  "$@"
  echo "{\"wall_seconds\": $(( $(date +%s) - started ))}" > "$OUT/$name.wall.json"
}

evaluate() {  # evaluate NAME [--adapter FOLDER]: sampled (n 4, T 0.8) and greedy pass@k on the test split
  local name=$1
  shift
  timed "eval-$name-sampled" "$ICRL" code-eval "${CONFIG[@]}" "$@" --threads 1 --seed 0 \
    --output "$OUT/eval-$name-sampled.json"
  timed "eval-$name-greedy" "$ICRL" code-eval "${CONFIG[@]}" "$@" --threads 1 --seed 0 --temperature 0 \
    --output "$OUT/eval-$name-greedy.json"
}

evaluate base
for seed in $SEEDS; do
  timed "grpo-$seed" "$ICRL" stage ppo "${CONFIG[@]}" --set seed="$seed" --set ppo.output_dir="$OUT/grpo-$seed"
  timed "dpo-$seed" "$ICRL" stage dpo "${CONFIG[@]}" --set seed="$seed" --set dpo.output_dir="$OUT/dpo-$seed"
  evaluate "grpo-$seed" --adapter "$OUT/grpo-$seed/adapter"
  evaluate "dpo-$seed" --adapter "$OUT/dpo-$seed/adapter"
done
