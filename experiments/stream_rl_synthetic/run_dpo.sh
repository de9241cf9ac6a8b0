#!/usr/bin/env bash
# The pre-registered DPO runs (PREREGISTERED.md, addendum): the dpo stage from run.sh's bootstrap adapter, seeds
# 0, 1, 2. Outputs under $OUT/dpo-SEED; collect.py adds them to results.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
ICRL=${ICRL:-.venv/bin/icrl}
OUT=${OUT:-runs/stream_rl_synthetic}
COMMON=(-c params.yaml -c experiments/stream_rl_synthetic/bootstrap-params.yaml
        --set ray.enabled=false --set tracking.experiment=stream-rl-synthetic
        --set data.output_dir="$OUT/dataset" --set tokenize.output_dir="$OUT/tokenized"
        --set bootstrap.output_dir="$OUT/bootstrap")
for seed in ${SEEDS:-0 1 2}; do
  run="$OUT/dpo-$seed"
  [ -e "$run/metrics.json" ] && continue
  started=$(date +%s)
  "$ICRL" stage dpo "${COMMON[@]}" --set seed="$seed" --set dpo.init_adapter="$OUT/bootstrap/adapter" \
    --set dpo.output_dir="$run"
  echo "{\"wall_seconds\": $(( $(date +%s) - started ))}" > "$run/wall.json"
done
