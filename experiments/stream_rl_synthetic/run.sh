#!/usr/bin/env bash
# The pre-registered runs of PREREGISTERED.md (beside this file): one bootstrap (the demo recipe's first stages,
# bootstrap-params.yaml), then stream-mode policy optimisation with GRPO and RLOO, seeds 0, 1, 2, each from that
# bootstrap adapter. Outputs under $OUT (default runs/stream_rl_synthetic, not in git); collect.py turns them
# into results.json. Every stage resumes from its checkpoint if the script is stopped and started again.
set -euo pipefail
cd "$(dirname "$0")/../.."
ICRL=${ICRL:-.venv/bin/icrl}
OUT=${OUT:-runs/stream_rl_synthetic}
KINDS=${KINDS:-grpo rloo}
SEEDS=${SEEDS:-0 1 2}
COMMON=(-c params.yaml -c experiments/stream_rl_synthetic/bootstrap-params.yaml
        --set ray.enabled=false --set tracking.experiment=stream-rl-synthetic
        --set data.output_dir="$OUT/dataset" --set tokenize.output_dir="$OUT/tokenized"
        --set bootstrap.output_dir="$OUT/bootstrap")
for stage in build_dataset tokenize bootstrap; do
  [ -e "$OUT/$stage.done" ] || { "$ICRL" stage "$stage" "${COMMON[@]}" && touch "$OUT/$stage.done"; }
done
for kind in $KINDS; do
  for seed in $SEEDS; do
    run="$OUT/$kind-$seed"
    [ -e "$run/metrics.json" ] && continue
    started=$(date +%s)
    "$ICRL" stage ppo "${COMMON[@]}" --set seed="$seed" --set ppo.init_adapter="$OUT/bootstrap/adapter" \
      --set ppo.output_dir="$run" --set ppo.mode=stream \
      --set 'ppo.stream={steps: 12, group_size: 4, groups: 2, eval_groups: 4}' \
      --set ppo.max_steps=10 --set ppo.eval_steps=5 --set ppo.learning_rate=1.0e-4 --set ppo.kl_beta=0.02 \
      --set ppo.gamma=0.7 --set ppo.temperature=1.0 --set ppo.epochs=1 --set ppo.minibatch_size=4 \
      --set "ppo.objective={kind: $kind}"
    echo "{\"wall_seconds\": $(( $(date +%s) - started ))}" > "$run/wall.json"
  done
done
