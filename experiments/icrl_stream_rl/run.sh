#!/usr/bin/env bash
# Issue 26's pre-registered runs (PREREGISTERED.md), each as written there, from the project's root:
#   experiments/icrl_stream_rl/run.sh TARGET [TARGET ...]
# Targets, run in the order given:
#   bootstrap     the H32 bootstrap: its datasets, then the recorded adapter (adapters/bootstrap_h32) or training
#   s14           setting 14 (addenda 14, 22): the dpo stage from the bootstrap, then its gate-1 probe and forgetting
#   s15           setting 15 (addenda 19-21): RLOO on explorative-view streams, then gate E and its probe
#   s15-gate2-SEED-STRATEGY  one part of setting 15's gate 2 (addenda 19, 23): the evaluate stage on seed SEED
#                 (100, 101, 102), strategy STRATEGY only, into artifacts/gate2_s15/seedSEED-STRATEGY, the
#                 adapter restored from adapters/explorative_streams (collect_gate2.py --seed SEED=FOLDER per part)
#   s15-forgetting  setting 15's gate 3 with the greedy check (addenda 14, 19): runs/s15/forgetting.json
#   s16           setting 16 (addendum 29): setting 15 with 60 burned-in queries per stream, then gate E16 (seed 7,
#                 explorative, 1000 steps) and its probe
#   s16-gate2-SEED-STRATEGY, s16-forgetting  as for s15, for setting 16 (only if gate E16 passes)
#   s17           setting 17 (addendum 31): setting 16 continued from its kept adapter, 40 iterations on fresh draws
#                 with one redraw of a uniform group, then gate E17 (seed 7, explorative, 1000 steps) and its probe
#   s17-gate2-SEED-STRATEGY, s17-forgetting  as for s15, for setting 17 (only if gate E17 passes)
#   s18           setting 18 (addendum 32): RLOO on naive-view streams after a shared burn-in at temperature 1.0,
#                 then gate N18 (seed 7, naive, 1000 steps) and its probe
#   s18-gate2-SEED-STRATEGY, s18-forgetting  as for s15, for setting 18 (only if gate N18 passes)
#   s19           setting 19 (addendum 33): setting 15 with the test reward (each stream's last step also paid
#                 10 x its context's expected accuracy on 16 held-out queries; gamma 1.0), then gate E19 (seed 7,
#                 explorative, 1000 steps) and its probe
#   s19-gate2-SEED-STRATEGY, s19-forgetting  as for s15, for setting 19 (only if gate E19 passes)
#   s20           setting 20 (addendum 35): setting 16 on streams of 6 named labels (banking77, clinc150), then
#                 gate E20 (seed 7, explorative, 1000 steps) and its probe
#   s20-gate2-SEED-STRATEGY, s20-forgetting  as for s15, for setting 20 (only if gate E20 passes)
#   s21           setting 21 (addendum 36): setting 16 on streams of the dry run's label count, then gate E21 at
#                 seeds 7 and 8 (explorative, 1000 steps), setting 16's adapter at seed 8 (reported), and its probe
#   s21-gate2-SEED-STRATEGY, s21-forgetting  as for s15, for setting 21 (only if gate E21 passes)
#   s22           setting 22 (addendum 38): setting 21 with groups of 8 streams at the same budget (20 iterations),
#                 then gate E22 at seeds 7 and 8 (explorative, 1000 steps) and its probe
#   s22-gate2-SEED-STRATEGY, s22-forgetting  as for s15, for setting 22 (only if gate E22 passes)
#   s23           setting 23 (addendum 40): no training; setting 16's step from the bootstrap taken twice
#                 (`icrl model extrapolate`, scale 2, from the two kept adapters) into
#                 artifacts/extrapolated_streams/adapter, then gate E23 at seeds 7 and 8 (explorative, 1000 steps)
#                 and its probe
#   s23-gate2-SEED-STRATEGY, s23-forgetting  as for s15, for setting 23 (only if gate E23 passes)
#   s24           setting 24 (addendum 41): no training; the average of settings 16's and 21's adapters (`icrl model
#                 extrapolate`, scale 0.5, from the two kept adapters) into artifacts/souped_streams/adapter, then
#                 gate E24 at seeds 7 and 8 (explorative, 1000 steps) and its probe
#   s24-gate2-SEED-STRATEGY, s24-forgetting  as for s15, for setting 24 (only if gate E24 passes)
#   s25           setting 25 (addendum 42): no training; the bootstrap plus settings 16's and 21's steps (`icrl model
#                 combine`, weights 1, 1, -1) into artifacts/summed_streams/adapter, then gate E25 at seeds 7 and 8
#                 (explorative, 1000 steps) and its probe
#   s25-gate2-SEED-STRATEGY, s25-forgetting  as for s15, for setting 25 (only if gate E25 passes)
#   s26           setting 26 (addendum 44): setting 16 with a right answer of a label its context lacks paid 1 + 1.0
#                 (ppo.stream.discovery_bonus) and p_keep 0.25, then gate E26 at seeds 7 and 8 (explorative, 1000
#                 steps; its rule reads test steps 499-999) and its probe
#   s26-gate2-SEED-STRATEGY, s26-forgetting  as for s15, for setting 26 (only if gate E26 passes)
#   s27-start     setting 27's start (addendum 45): the H32 bootstrap recipe stopped at 25 steps (its datasets, then
#                 artifacts/bootstrap_short, or its kept copy adapters/bootstrap_short), its runs at seeds 7 and 8
#                 (explorative, 1000 steps) beside the H32 bootstrap's, and its probe
#   s27           setting 27 (addendum 45): setting 16's RL stage from that 25-step bootstrap, then gate E27 at seeds
#                 7 and 8 against it (explorative, 1000 steps; its rule reads test steps 499-999) and its probe
#   s27-gate2-SEED-STRATEGY, s27-forgetting  as for s15, for setting 27 against the 25-step bootstrap (only if gate
#                 E27 passes)
#   s28           setting 28 (addendum 46): setting 16 with its trained steps sampled and trained at temperature 1.0
#                 (the test predictions'), the burn-in at 2.0, then gate E28 at seeds 7 and 8 (explorative, 1000
#                 steps; its rule reads test steps 499-999) and its probe
#   s34           setting 34 (addendum 55): setting 26 with p_keep 0.1 and a discovery paid 1 + 3.0, then check C34
#                 (the closure probe of its adapter and setting 26's; absent recall - false alarm >= collect.CHECK_C,
#                 else it stops), gate E34 at seeds 7 and 8 (explorative, 1000 steps; test steps 499-999), its probe
#   s34-gate2-SEED-STRATEGY, s34-forgetting  as for s15, for setting 34 (only if gate E34 passes)
#   s35           setting 35 (addendum 56): setting 34 on the named-label tasks only, then check C35 (the closure
#                 probe of its adapter, and setting 34's when it is there (addendum 57); as C34), gate E35 at seeds 7 and 8
#                 (explorative, 1000 steps; test steps 499-999), its probe
#   s35-gate2-SEED-STRATEGY, s35-forgetting  as for s15, for setting 35 (only if gate E35 passes)
#   s28-gate2-SEED-STRATEGY, s28-forgetting  as for s15, for setting 28 (only if gate E28 passes)
#   s29           setting 29 (addendum 47): setting 18 with every stream's queries in label runs (repeat_label
#                 0.5), then its probe (trec_coarse, and banking77 reported), check P29 (the trec_coarse probe's
#                 n=1 feedback effect >= +0.10; below it the setting stops), then gate N29 at seeds 7 and 8 (naive,
#                 1000 steps; its rule reads test steps 499-999)
#   s29-gate2-SEED-STRATEGY, s29-forgetting  as for s15, for setting 29 (only if gate N29 passes)
#   probe-banking77-bootstrap  the banking77 probe of the bootstrap adapter (setting 29's reported comparison)
#   s30           setting 30 (addendum 50): setting 29's streams from check L49's adapter at its learning rate
#                 (5e-4), 30 iterations, then its probes, check P30 (as P29) and gate N30 at seeds 7 and 8
#   s30-gate2-SEED-STRATEGY, s30-forgetting  as for s15, for setting 30 (only if gate N30 passes)
#   s31           setting 31 (addendum 51): setting 29 exactly at learning rate 5e-4, then its probes, check P31
#                 (as P29) and gate N31 at seeds 7 and 8
#   s31-gate2-SEED-STRATEGY, s31-forgetting  as for s15, for setting 31 (only if gate N31 passes)
#   s32           setting 32 (addendum 52): no training; gate N32 at seeds 7 and 8 on check L49's kept adapter
#   s32-gate2-SEED-STRATEGY, s32-forgetting  as for s15, for setting 32 (only if gate N32 passes)
#   s33           setting 33 (addendum 53): no training; gate N33 at seeds 7 and 8 on check L50's adapter, only
#                 after check L50 passed
#   s33-gate2-SEED-STRATEGY, s33-forgetting  as for s15, for setting 33 (only if gate N33 passes)
#   l48           addendum 48's learnability check: setting 29's RL on 2-label opaque-label streams in label runs
#                 (p 0.9), 60 iterations, then check L48 (runs/l48/check.json) and both probes (reported)
#   l49           addendum 49's check L49: L48 at five times the learning rate (run only if L48 fails)
#   l50           addendum 53's check L50: L49 with each stream's queries drawn independently (repeat_label 0),
#                 then its decision (runs/l50/check.json: reward gain >= +0.10) and both probes
#   l51           addendum 58's check L51, no training: p(gold) of the base model and the H32 bootstrap on check
#                 L50's kind of streams with gold-labelled, right-marked and verdict-marked contexts
#                 (class_verdict_ceiling.py, runs/l51/ceiling.json)
#   l52           addendum 59's check L52: L50 with a shared 6-query burn-in at temperature 100 before 4 trained
#                 steps, 4 groups, then its decision (L51's probe of its adapter beside the bootstrap's,
#                 runs/l52/ceiling.json: verdict p(gold) gain >= +0.10) and both feedback probes
#   s36           setting 36 (addendum 59): no training, gate N on check L52's adapter as it is, only if L52 passed
#   l53           addendum 60's check L53, no training: L51's probe on 2-label streams of trec_coarse's named labels
#                 (its train split) of the base model, the H32 bootstrap and check L52's adapter: "carries" when the
#                 adapter's verdict p(gold) gain is >= +0.08 (runs/l53/ceiling.json, "passed"); the 6-label streams
#                 reported (runs/l53/ceiling-six.json)
#   s37           setting 37 (addendum 60), only if gate N36 failed and check L53 read "does not carry": check L52's
#                 stage continued from its adapter on the four training tasks' streams, 40 iterations, check L54
#                 (L53's probe of its adapter: verdict gain >= +0.08, runs/s37/ceiling.json), then gate N37
#   l55           addendum 61's check L55, no training: L53's 6-label probe of setting 37's adapter beside the
#                 bootstrap's: "six carries" when its verdict p(gold) gain is >= +0.08 (runs/l55/ceiling-six.json)
#   s38           setting 38 (addendum 61), only after gate N37 failed and check L55 ran: branch "six gap" (L55
#                 failed) continues setting 37's stage on 6-label streams, 40 iterations, then check L56 (L55's
#                 probe of its adapter, runs/s38/ceiling-six.json) and, if it passed, gate N38; branch "six carries"
#                 does it with a 30-query burn-in, 20 iterations, then gate N38
#   ablation-ARM  the objective ablation (addenda 15, 17), ARM = ppo, grpo, rloo or dpo_rank, then its probe
#   probe-bootstrap  the gate-1 probe of the bootstrap adapter (the gate table's "start" row)
#   final-TASK    the final tests of the finished recipe (addendum 39), TASK = trec_fine, trec_fine_unsemantic,
#                 nlu or nlu_unsemantic: the recipe's evaluate stage on TASK, seed 100, explorative and
#                 zero-shot, base model, adapters/recipe_bootstrap and adapters/recipe_rl, into
#                 artifacts/final_tests/TASK
#   cd-plain, cd-distill  issue 29's students (addendum 27): settings 1 and 2 trained again from the kept bootstrap
#                 into artifacts/cd_plain and artifacts/cd_distill, then their gate-1 probe and forgetting measures
#   cd-eval-SEED-ARM  one naive evaluation part of addendum 27 (SEED 100, 101, 102; ARM plain or distill) into
#                 artifacts/cd_eval/seedSEED-ARM (the evaluate stage's outputs), the student restored from
#                 adapters/cd_ARM when artifacts/cd_ARM has none
#   park          after stopping a run that cannot finish inside the session (addendum 23): copy to checkpoints/
#                 beside this script, to be committed, each stage's latest checkpoint
#                 (.icrl/checkpoints/<stage>-<config fingerprint>/step-N), the outputs of a training target that has
#                 not finished (artifacts/<output_dir>, until runs/<target>/probe.json exists) and the evaluation
#                 run store (.icrl/evaluations, copied by `icrl redact`: no query text, which must not enter the
#                 repository; merged by park_evaluations.py: the logs of runs in progress, the runs finished since
#                 the last park and new probe caches, not every run ever finished; `icrl check-text` then
#                 searches everything parked for the datasets' texts and fails on a hit). Every training
#                 target first restores what is parked, so the next session's run resumes: the stage from its
#                 checkpoint (the fingerprint in the folder name only matches the same settings), a trained stage is
#                 not trained again, an evaluation goes on from its log. Delete the parked folder once its run ends
# A training target whose adapter is kept in the repository (adapters/<output_dir>, checked against its SHA256SUMS)
# restores it instead of training again; RETRAIN=1 trains it again (into artifacts/, the kept copy untouched).
# Outputs: artifacts/<setting's output_dir>, runs/<target>/probe.json, runs/<target>/forgetting.json; collect them
# with collect.py / collect_gate_e.py (REPORT.md). Each step is retried twice: a stage killed mid-run (Ray's memory
# monitor, a crash) resumes from its last checkpoint. A session's files may end with it: a run that does not fit in
# one is parked (`park`) and resumed in the next.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 DO_NOT_TRACK=true DVC_NO_ANALYTICS=1 MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
E=experiments/icrl_stream_rl
ICRL=.venv/bin/icrl
# The skill recipe as these runs layered it: its RL stage is now setting 16's, h32_ppo.yaml restores the keys
SKILL=(-c params.yaml -c experiments/icrl_skill.yaml -c $E/h32_ppo.yaml)
# The skill recipe as it is now (bootstrap -> setting 16's RL stage): what the final tests evaluate
RECIPE=(-c params.yaml -c experiments/icrl_skill.yaml)
FINAL_TASKS="trec_fine trec_fine_unsemantic nlu nlu_unsemantic"

step() {  # step NAME COMMAND...: run, retried twice, timestamps in the log
    local name=$1 try
    shift
    for try in 1 2 3; do
        echo "== $(date -u +%FT%TZ) $name (try $try)"
        if "$@"; then echo "== $(date -u +%FT%TZ) $name done"; return 0; fi
    done
    echo "== $name failed three times" >&2
    exit 1
}

probe() {  # probe ADAPTER OUTPUT: gate 1's feedback probe (trec_coarse, target entity, 40 queries, seed 0, fp32)
    mkdir -p "$(dirname "$2")"
    step "probe $1" "$ICRL" probe-feedback --task trec_coarse --target entity --attempts 1 --attempts 4 \
        --queries 40 --seed 0 --dtype float32 --threads 2 --adapter "$1" --output "$2" --no-progress
}

probe_banking77() {  # probe_banking77 ADAPTER OUTPUT: the probe on a training task (banking77, target `card arrival`,
                    # 40 queries, seed 0, fp32; addendum 47): reported beside gate 1's, not a gate
    mkdir -p "$(dirname "$2")"
    step "probe banking77 $1" "$ICRL" probe-feedback --task banking77 --target "card arrival" --attempts 1 \
        --attempts 4 --queries 40 --seed 0 --dtype float32 --threads 2 --adapter "$1" --output "$2" --no-progress
}

probe_check() {  # probe_check PROBE_JSON SETTING: check P (addendum 47): the n=1 feedback effect of a probe at
                 # least the setting's collect.CHECK_P, else the setting stops before its gate runs (exit status 1)
    .venv/bin/python - "$1" "$2" "$E" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[3])
from collect import CHECK_P  # the threshold's one place (results.json records it from there too)
effect, least = json.load(open(sys.argv[1]))["feedback_effect"]["1"], CHECK_P[sys.argv[2]]
passed = effect >= least
print(f"== check P{sys.argv[2]}: n=1 feedback effect {effect:+.3f}, rule >= +{least:.2f}: "
      f"{'passed, the gate runs follow' if passed else 'failed, the setting stops here (no gate runs)'}")
sys.exit(0 if passed else 1)
PY
}

closure_check() {  # closure_check SETTING NAME=ADAPTER...: check C (addendum 55): the closure probe of the adapters
                   # (runs/sSETTING/closure.json); the first one's absent recall - false alarm at least
                   # collect.CHECK_C[SETTING], else the setting stops before its gate runs (exit status 1)
    local setting=$1
    shift
    [[ -f runs/s$setting/closure.json ]] || step "check C$setting: closure probe" .venv/bin/python \
        $E/closure_probe.py --task trec_coarse "$@" --output "runs/s$setting/closure.json"
    .venv/bin/python - "runs/s$setting" "$setting" "${1%%=*}" "$E" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from collect import CHECK_C  # the threshold's one place
from icrl_core.io import atomic_write_json
runs, setting, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
row = json.load(open(runs / "closure.json"))[name]
margin, least = row["absent_recall"] - row["false_alarm"], CHECK_C[setting]
passed = margin >= least
atomic_write_json(runs / "check.json", {"check": f"C{setting}", "adapter": row["adapter"],
                  "absent_recall": row["absent_recall"], "false_alarm": row["false_alarm"], "margin": margin,
                  "rule": f"absent_recall - false_alarm >= {least}", "passed": passed})
print(f"== check C{setting}: absent recall {row['absent_recall']:.3f} - false alarm {row['false_alarm']:.3f} = "
      f"{margin:+.3f}, rule >= +{least:.2f}: {'passed, the gate runs follow' if passed else 'failed, the setting stops here'}")
sys.exit(0 if passed else 1)
PY
}

forgetting() {  # forgetting ADAPTER OUTPUT: the 197-question greedy check and the 1509-item probe, base and adapter
    step "forgetting $1" .venv/bin/python "$E/forgetting.py" "$1" "$2" "${SKILL[@]}"
}

PARKED=$E/checkpoints
# Each training target's output folder (its output_dir) and the file its last step writes.
declare -A FINAL=([dpo_one_stage]=runs/s14/probe.json [explorative_streams]=runs/s15/probe.json
                  [ablation_ppo]=runs/ablation-ppo/probe.json [ablation_grpo]=runs/ablation-grpo/probe.json
                  [ablation_rloo]=runs/ablation-rloo/probe.json [ablation_dpo_rank]=runs/ablation-dpo_rank/probe.json
                  [cd_plain]=runs/cd-plain/forgetting.json [cd_distill]=runs/cd-distill/forgetting.json
                  [burn_in_streams]=runs/s16/probe.json [burn_in_streams_more]=runs/s17/probe.json
                  [naive_burn_in]=runs/s18/probe.json [test_reward_streams]=runs/s19/probe.json
                  [six_label_streams]=runs/s20/probe.json [many_label_streams]=runs/s21/probe.json
                  [wide_group_streams]=runs/s22/probe.json [discovery_streams]=runs/s26/probe.json
                  [bootstrap_short]=runs/s27/probe-start.json [short_start_streams]=runs/s27/probe.json
                  [test_temperature_streams]=runs/s28/probe.json [label_run_streams]=runs/s29/probe.json
                  [feedback_learnability]=runs/l48/probe.json
                  [feedback_learnability_lr]=runs/l49/probe.json
                  [carry_verdict_streams]=runs/s30/probe.json
                  [label_run_streams_lr]=runs/s31/probe.json
                  [class_verdict_learnability]=runs/l50/probe.json
                  [closure_streams]=runs/s34/probe.json
                  [named_closure_streams]=runs/s35/probe.json)

unpark() {  # restore what park kept: a checkpoint unless its stage already has that step or a later one, a
            # trained output folder unless its adapter is there, evaluation work folders not there yet
    local parked output
    [[ -d $PARKED ]] || return 0
    for parked in "$PARKED"/*/step-*; do
        [[ -e $parked ]] || continue
        local dest=.icrl/checkpoints/$(basename "$(dirname "$parked")")/$(basename "$parked")
        local newest
        newest=$(ls -d "$(dirname "$dest")"/step-* 2>/dev/null | sort | tail -1 || true)
        if [[ -z $newest || $(basename "$newest") < $(basename "$parked") ]]; then
            mkdir -p "$(dirname "$dest")"
            cp -r "$parked" "$dest.tmp" && mv "$dest.tmp" "$dest"
            echo "== restored the parked checkpoint $dest"
        fi
    done
    for output in "${!FINAL[@]}"; do
        if [[ -d $PARKED/artifacts/$output && ! -e artifacts/$output/adapter ]]; then
            mkdir -p artifacts
            rm -rf "artifacts/$output" "artifacts/$output.tmp"
            cp -r "$PARKED/artifacts/$output" "artifacts/$output.tmp" && mv "artifacts/$output.tmp" "artifacts/$output"
            echo "== restored the parked outputs artifacts/$output"
        fi
    done
    if [[ -d $PARKED/evaluations ]]; then
        mkdir -p .icrl/evaluations
        cp -rn "$PARKED/evaluations/." .icrl/evaluations/  # -n: a log that went further here stays
        drop_finished_partials
    fi
}

drop_finished_partials() {  # a run's work folder (partial/KEY) once the run is stored (KEY): the stage stores a
                            # finished run and then deletes its work folder, so one left over is stale (a kill in
                            # between, or an older park restored): never resumed, not to be parked again
    local work
    for work in .icrl/evaluations/partial/*/; do
        [[ -d $work && -d .icrl/evaluations/$(basename "$work") ]] || continue
        rm -rf "$work"
        echo "== removed the work folder of a stored run: $work"
    done
}

park() {  # the latest checkpoint of every stage, unfinished targets' outputs, evaluation work folders -> $PARKED
    local run latest output
    for run in .icrl/checkpoints/*/; do
        latest=$(ls -d "$run"step-* 2>/dev/null | sort | tail -1 || true)  # none: ls fails (pipefail)
        [[ -n $latest ]] || continue
        rm -rf "$PARKED/$(basename "$run")"
        mkdir -p "$PARKED/$(basename "$run")"
        cp -r "$latest" "$PARKED/$(basename "$run")/"
        echo "== parked $latest in $PARKED/$(basename "$run"): commit it"
    done
    for output in "${!FINAL[@]}"; do
        if [[ -f artifacts/$output/adapter/adapter_model.safetensors && ! -f ${FINAL[$output]} ]]; then
            if is_kept_copy "$output"; then continue; fi  # restored from adapters/: the repository has it
            rm -rf "$PARKED/artifacts/$output"
            mkdir -p "$PARKED/artifacts"
            cp -r "artifacts/$output" "$PARKED/artifacts/$output"
            echo "== parked artifacts/$output (trained; ${FINAL[$output]} not written yet): commit it"
        fi
    done
    if [[ -d .icrl/evaluations ]]; then
        drop_finished_partials
        rm -rf "$PARKED/evaluations.staged"
        mkdir -p "$PARKED"
        # without the queries' text (each a SHA-256 digest; the run resumes from it): the datasets stay out of git
        "$ICRL" redact .icrl/evaluations "$PARKED/evaluations.staged"
        # merged, not replaced: the runs in progress, the runs finished since the last park, new probe caches
        .venv/bin/python "$E/park_evaluations.py" "$PARKED/evaluations.staged" "$PARKED/evaluations"
        rm -rf "$PARKED/evaluations.staged"
        echo "== parked .icrl/evaluations into $PARKED/evaluations (no query text): commit it"
    fi
    if [[ -d $PARKED ]]; then  # fails (exit 1) if any parked file holds a dataset's text: nothing to commit then
        "$ICRL" check-text "$PARKED"
    fi
}

is_kept_copy() {  # is_kept_copy OUTPUT_DIR: artifacts/OUTPUT_DIR/adapter holds the files of adapters/OUTPUT_DIR
    local sums=$PWD/$E/adapters/$1/SHA256SUMS
    [[ -f $sums ]] && (cd "artifacts/$1/adapter" && sha256sum --quiet --status -c "$sums")
}

restore_kept() {  # restore_kept NAME DEST: the adapter kept in the repository (adapters/NAME) -> DEST, when
                  # DEST has none; fails (1) when the kept files do not match their SHA256SUMS
    local kept=$E/adapters/$1 dest=$2
    [[ -f $dest/adapter_model.safetensors ]] && return 0
    if ! (cd "$kept" && sha256sum --quiet -c SHA256SUMS); then
        echo "run.sh: $kept does not match its SHA256SUMS" >&2
        return 1
    fi
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp"
    cp $(awk -v d="$kept/" '{print d $2}' "$kept/SHA256SUMS") "$dest.tmp/"
    mv "$dest.tmp" "$dest"
    echo "== restored the kept adapter $kept -> $dest"
}

# The trained output (and kept adapter) of the settings whose gate-2 parts and forgetting targets run here.
declare -A SETTING_OUTPUT=([15]=explorative_streams [16]=burn_in_streams [17]=burn_in_streams_more
                         [18]=naive_burn_in [19]=test_reward_streams [20]=six_label_streams
                         [21]=many_label_streams [22]=wide_group_streams [23]=extrapolated_streams
                         [24]=souped_streams [25]=summed_streams [26]=discovery_streams
                         [27]=short_start_streams [28]=test_temperature_streams [29]=label_run_streams
                         [30]=carry_verdict_streams [31]=label_run_streams_lr
                         [32]=feedback_learnability_lr [33]=class_verdict_learnability
                         [34]=closure_streams [35]=named_closure_streams
                         [36]=verdict_reading_streams [37]=named_verdict_streams
                         [38]=six_verdict_streams)
# The bootstrap a setting started from when it is not the H32 one (its kept adapter; gate 2 compares with it).
declare -A SETTING_START=([27]=bootstrap_short)

setting_output() {  # setting_output SETTING TARGET: sets `output` to SETTING_OUTPUT[SETTING], or says which settings have one
    output=${SETTING_OUTPUT[$1]:-}
    [[ -n $output ]] && return 0
    local settings
    settings=$(printf "%s\n" "${!SETTING_OUTPUT[@]}" | sort | paste -sd " ")
    echo "run.sh: '$2': setting $1 has no gate-2 or forgetting targets (settings: $settings)" >&2
    return 1
}

# Adapters derived from kept adapters without training (deterministic: nothing of them is kept in the repository):
# output dir -> "extrapolate START_KEPT TRAINED_KEPT SCALE" (`icrl model extrapolate`) or "combine KEPT:WEIGHT ..."
# (`icrl model combine`).
declare -A DERIVED=([extrapolated_streams]="extrapolate bootstrap_h32 burn_in_streams 2"   # setting 23 (addendum 40)
                    [souped_streams]="extrapolate many_label_streams burn_in_streams 0.5"  # setting 24 (addendum 41)
                    [summed_streams]="combine burn_in_streams:1 many_label_streams:1 bootstrap_h32:-1")  # 25 (42)

kept_folder() {  # kept_folder KEPT: where run.sh restores adapters/KEPT
    if [[ $1 == bootstrap_h32 ]]; then echo artifacts/bootstrap/adapter; else echo "artifacts/$1/adapter"; fi
}

derived() {  # derived OUTPUT_DIR: artifacts/OUTPUT_DIR/adapter built from the kept adapters DERIVED names
    [[ -f artifacts/$1/adapter/adapter_model.safetensors ]] && return 0
    local words part kept=() args=()
    read -ra words <<< "${DERIVED[$1]}"
    if [[ ${words[0]} == extrapolate ]]; then  # START TRAINED SCALE
        kept=("${words[1]}" "${words[2]}")
        args=("$(kept_folder "${words[1]}")" "$(kept_folder "${words[2]}")" --scale "${words[3]}")
    else  # KEPT:WEIGHT ...
        for part in "${words[@]:1}"; do kept+=("${part%%:*}"); done
        for part in "${kept[@]}"; do args+=("$(kept_folder "$part")"); done
        for part in "${words[@]:1}"; do args+=(--weight "${part#*:}"); done
    fi
    for part in "${kept[@]}"; do restore_kept "$part" "$(kept_folder "$part")" || return 1; done
    step "$1: ${words[0]}" "$ICRL" model "${words[0]}" "${args[@]}" --output "artifacts/$1/adapter"
}

setting_adapter() {  # setting_adapter OUTPUT_DIR: artifacts/OUTPUT_DIR/adapter, restored from its kept copy or, for
                     # a DERIVED one, built from the kept adapters it is derived from
    if [[ -n ${DERIVED[$1]:-} ]]; then derived "$1"; else restore_kept "$1" "artifacts/$1/adapter"; fi
}

gate2_part() {  # gate2_part SETTING OUTPUT_DIR TARGET: one part of a setting's gate 2, TARGET sSETTING-gate2-SEED-STRATEGY:
                # the evaluate stage on seed SEED, strategy STRATEGY only, the adapter restored from adapters/OUTPUT_DIR
    local part=${3#s$1-gate2-} adapter=artifacts/$2/adapter
    local seed=${part%%-*} strategy=${part#*-} start=artifacts/bootstrap/adapter
    restore_kept bootstrap_h32 artifacts/bootstrap/adapter || return 1
    if [[ -n ${SETTING_START[$1]:-} ]]; then
        start=artifacts/${SETTING_START[$1]}/adapter
        restore_kept "${SETTING_START[$1]}" "$start" || return 1
    fi
    setting_adapter "$2" || return 1
    step "$3" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml --set "icrl_eval.seed=$seed" \
        --set "evaluate.adapter=$adapter" --set "evaluate.start_adapter=$start" --set "evaluate.strategies=[$strategy]" \
        --set "evaluate.output_dir=artifacts/gate2_s$1/seed$seed-$strategy"
}

gate_failed() {  # gate_failed SETTING: its development gate is collected into results.json as failed
    .venv/bin/python -c 'import json, sys; r = json.load(open(sys.argv[1]))
sys.exit(r["gate_e"][sys.argv[2]]["decision"]["verdict"] != "failed")' $E/results.json "$1" 2>/dev/null
}

# Setting 37's stage (addendum 60): check L52's layers, then named_verdict_streams.yaml; setting 38 layers after it
NAMED_VERDICT=(-c $E/stream_rl.yaml -c $E/feedback_learnability.yaml -c $E/feedback_learnability_lr.yaml
               -c $E/class_verdict_learnability.yaml -c $E/verdict_reading_streams.yaml
               -c $E/named_verdict_streams.yaml)

verdict_probe_six() {  # verdict_probe_six NAME OUTPUT MODEL=ADAPTER...: check L53's six-label probe (trec_coarse's
                      # train split) of the models, decided for `trained` against `bootstrap` at +0.08
    local name=$1 output=$2
    shift 2
    step "$name" .venv/bin/python $E/class_verdict_ceiling.py "$@" --layer $E/trec_verdict_probe.yaml \
        --layer $E/trec_verdict_probe_six.yaml --split train --check trained --gain 0.08 --output "$output"
}

gate_naive_two_seeds() {  # gate_naive_two_seeds SETTING [--set K=V ...]: its naive development gate at seeds 7
                         # and 8 (addendum 47), gate_naive_sSETTING.yaml and any overrides after it; outputs
                         # artifacts/gate_naive_sSETTING[_seed8]
    local seed
    for seed in 7 8; do
        step "gate N$1 seed $seed" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml \
            -c "$E/gate_naive_s$1.yaml" "${@:2}" --set "icrl_eval.seed=$seed" \
            --set "evaluate.output_dir=artifacts/gate_naive_s$1$([[ $seed == 7 ]] || echo _seed$seed)" || return 1
    done
}

gate_two_seeds() {  # gate_two_seeds SETTING: its development gate E at seeds 7 and 8 (addenda 36, 38), the
                   # adapter gate_explorative_sSETTING.yaml names; outputs artifacts/gate_explorative_sSETTING[_seed8]
    local seed
    for seed in 7 8; do
        step "gate E$1 seed $seed" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml \
            -c $E/gate_explorative_long.yaml -c "$E/gate_explorative_s$1.yaml" --set "icrl_eval.seed=$seed" \
            --set "evaluate.output_dir=artifacts/gate_explorative_s$1$([[ $seed == 7 ]] || echo _seed$seed)" || return 1
    done
}

naive_gated_setting() {  # naive_gated_setting SETTING OUTPUT_DIR CONFIG_ARGS...: addenda 47, 50, 51: the ppo stage
                         # (after stream_rl.yaml), both probes, check P (the trec_coarse probe's n=1 feedback effect
                         # >= +0.10, else the setting stops here), then gate N at seeds 7 and 8
    local setting=$1 output=$2
    shift 2
    trained "$output" || step "s$setting" "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml "$@"
    [[ -f runs/s$setting/probe-banking77.json ]] || probe_banking77 "artifacts/$output/adapter" \
        "runs/s$setting/probe-banking77.json"
    [[ -f runs/s$setting/probe.json ]] || probe "artifacts/$output/adapter" "runs/s$setting/probe.json"
    probe_check "runs/s$setting/probe.json" "$setting" || exit 0
    gate_naive_two_seeds "$setting" || exit 1
}

learnability_check() {  # learnability_check TARGET OUTPUT_DIR CONFIG_ARGS...: addenda 48, 49, 53's checks: the ppo
                        # stage from the H32 bootstrap, the check's decision (runs/TARGET/check.json), both probes
    local target=$1 output=$2
    shift 2
    restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
    trained "$output" || step "$target" "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml "$@"
    .venv/bin/python $E/check_learnability.py "artifacts/$output/evals.json" "runs/$target/check.json"
    [[ -f runs/$target/probe-banking77.json ]] || probe_banking77 "artifacts/$output/adapter" \
        "runs/$target/probe-banking77.json"
    [[ -f runs/$target/probe.json ]] || probe "artifacts/$output/adapter" "runs/$target/probe.json"
}

trained() {  # trained OUTPUT_DIR: its adapter is there (trained, restored by unpark, or the copy kept in
            # adapters/OUTPUT_DIR restored now unless RETRAIN=1), so no training again
    if [[ ! -f artifacts/$1/adapter/adapter_model.safetensors && -f $E/adapters/$1/SHA256SUMS && ${RETRAIN:-0} != 1 ]]
    then
        restore_kept "$1" "artifacts/$1/adapter" || exit 1
    fi
    [[ -f artifacts/$1/adapter/adapter_model.safetensors ]] || return 1
    echo "== artifacts/$1/adapter is there: not trained again"
}

for target in "$@"; do
    case "$target" in s[0-9][0-9]|s[0-9][0-9]-*|l[0-9][0-9]|ablation-*|cd-*|final-*) unpark ;; esac
    case "$target" in
        bootstrap)  # the recorded adapter when it verifies (adapters/bootstrap_h32/README.md), else trained
            for stage in build_dataset tokenize; do step "$stage" "$ICRL" stage "$stage" "${SKILL[@]}"; done
            if [[ -f artifacts/bootstrap/adapter/adapter_model.safetensors ]]; then
                echo "== bootstrap: artifacts/bootstrap/adapter is there"
            elif restore_kept bootstrap_h32 artifacts/bootstrap/adapter; then
                :
            else
                step bootstrap "$ICRL" stage bootstrap "${SKILL[@]}"
            fi ;;
        s14)
            trained dpo_one_stage || step s14 "$ICRL" stage dpo "${SKILL[@]}" -c $E/hindsight_dpo.yaml \
                -c $E/one_stage_rank_replay.yaml --set model.share_prefix=true
            probe artifacts/dpo_one_stage/adapter runs/s14/probe.json
            forgetting artifacts/dpo_one_stage/adapter runs/s14/forgetting.json ;;
        s15)
            trained explorative_streams || step s15 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml
            step "gate E" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml -c $E/gate_explorative.yaml
            probe artifacts/explorative_streams/adapter runs/s15/probe.json ;;
        s27-start)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            if ! trained bootstrap_short; then
                for stage in build_dataset tokenize; do step "$stage" "$ICRL" stage "$stage" "${SKILL[@]}"; done
                step s27-start "$ICRL" stage bootstrap "${SKILL[@]}" -c $E/short_bootstrap.yaml
            fi
            gate_two_seeds 27_start || exit 1
            probe artifacts/bootstrap_short/adapter runs/s27/probe-start.json ;;
        s27)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained bootstrap_short || { echo "run.sh s27: run s27-start first (artifacts/bootstrap_short)" >&2; exit 2; }
            trained short_start_streams || step s27 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/short_start_streams.yaml
            gate_two_seeds 27 || exit 1
            probe artifacts/short_start_streams/adapter runs/s27/probe.json ;;
        s28)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained test_temperature_streams || step s28 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/test_temperature_streams.yaml
            gate_two_seeds 28 || exit 1
            probe artifacts/test_temperature_streams/adapter runs/s28/probe.json ;;
        s29)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            naive_gated_setting 29 label_run_streams -c $E/naive_burn_in.yaml -c $E/label_run_streams.yaml ;;
        s30)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained feedback_learnability_lr ||
                { echo "run.sh s30: run l49 first (artifacts/feedback_learnability_lr)" >&2; exit 2; }
            naive_gated_setting 30 carry_verdict_streams -c $E/naive_burn_in.yaml -c $E/label_run_streams.yaml \
                -c $E/carry_verdict_streams.yaml ;;
        s31)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            naive_gated_setting 31 label_run_streams_lr -c $E/naive_burn_in.yaml -c $E/label_run_streams.yaml \
                -c $E/label_run_streams_lr.yaml ;;
        s32)  # addendum 52: no training, gate N on check L49's kept adapter as it is (its check P: L49's probe)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained feedback_learnability_lr ||
                { echo "run.sh s32: run l49 first (artifacts/feedback_learnability_lr)" >&2; exit 2; }
            gate_naive_two_seeds 32 || exit 1 ;;
        s33)  # addendum 53: no training, gate N on check L50's adapter as it is, only if L50 passed
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            if ! grep -q '"verdict": "passed"' runs/l50/check.json 2>/dev/null; then
                echo "run.sh s33: setting 33 runs only after check L50 passed (runs/l50/check.json; run l50 first)" >&2
                exit 2
            fi
            trained class_verdict_learnability ||
                { echo "run.sh s33: run l50 first (artifacts/class_verdict_learnability)" >&2; exit 2; }
            gate_naive_two_seeds 33 || exit 1 ;;
        l48)
            learnability_check l48 feedback_learnability -c $E/feedback_learnability.yaml ;;
        l49)
            learnability_check l49 feedback_learnability_lr -c $E/feedback_learnability.yaml \
                -c $E/feedback_learnability_lr.yaml ;;
        l50)
            learnability_check l50 class_verdict_learnability -c $E/feedback_learnability.yaml \
                -c $E/feedback_learnability_lr.yaml -c $E/class_verdict_learnability.yaml ;;
        l51)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            mkdir -p runs/l51
            step l51 .venv/bin/python $E/class_verdict_ceiling.py base=base bootstrap=artifacts/bootstrap/adapter \
                --output runs/l51/ceiling.json ;;
        l52)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained verdict_reading_streams || step l52 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/feedback_learnability.yaml -c $E/feedback_learnability_lr.yaml \
                -c $E/class_verdict_learnability.yaml -c $E/verdict_reading_streams.yaml
            mkdir -p runs/l52
            [[ -f runs/l52/ceiling.json ]] || step "check L52" .venv/bin/python $E/class_verdict_ceiling.py \
                base=base bootstrap=artifacts/bootstrap/adapter trained=artifacts/verdict_reading_streams/adapter \
                --check trained --output runs/l52/ceiling.json
            [[ -f runs/l52/probe-banking77.json ]] || probe_banking77 artifacts/verdict_reading_streams/adapter \
                runs/l52/probe-banking77.json
            [[ -f runs/l52/probe.json ]] || probe artifacts/verdict_reading_streams/adapter runs/l52/probe.json ;;
        s36)  # addendum 59: no training, gate N on check L52's adapter as it is, only if L52 passed
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            if ! grep -q '"verdict": "passed"' runs/l52/ceiling.json 2>/dev/null; then
                echo "run.sh s36: setting 36 runs only after check L52 passed (runs/l52/ceiling.json; run l52 first)" >&2
                exit 2
            fi
            trained verdict_reading_streams ||
                { echo "run.sh s36: run l52 first (artifacts/verdict_reading_streams)" >&2; exit 2; }
            gate_naive_two_seeds 36 || exit 1 ;;
        l53)  # addendum 60: no training
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            restore_kept verdict_reading_streams artifacts/verdict_reading_streams/adapter || exit 1
            mkdir -p runs/l53
            [[ -f runs/l53/ceiling.json ]] || step "check L53" .venv/bin/python $E/class_verdict_ceiling.py \
                base=base bootstrap=artifacts/bootstrap/adapter trained=artifacts/verdict_reading_streams/adapter \
                --layer $E/trec_verdict_probe.yaml --split train --check trained --gain 0.08 \
                --output runs/l53/ceiling.json || exit 1
            [[ -f runs/l53/ceiling-six.json ]] || verdict_probe_six "check L53, six labels" runs/l53/ceiling-six.json \
                base=base bootstrap=artifacts/bootstrap/adapter trained=artifacts/verdict_reading_streams/adapter \
                || exit 1 ;;
        s37)  # addendum 60: only if gate N36 failed and check L53 read "does not carry"
            if ! gate_failed 36; then
                echo "run.sh s37: setting 37 runs only after gate N36 failed (collect it into results.json first)" >&2
                exit 2
            fi
            if ! grep -q '"verdict": "failed"' runs/l53/ceiling.json 2>/dev/null; then
                echo "run.sh s37: setting 37 runs only after check L53 read \"does not carry\" (run l53 first)" >&2
                exit 2
            fi
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            restore_kept verdict_reading_streams artifacts/verdict_reading_streams/adapter || exit 1
            trained named_verdict_streams || step s37 "$ICRL" stage ppo "${SKILL[@]}" "${NAMED_VERDICT[@]}" || exit 1
            mkdir -p runs/s37
            [[ -f runs/s37/ceiling.json ]] || step "check L54" .venv/bin/python $E/class_verdict_ceiling.py \
                bootstrap=artifacts/bootstrap/adapter trained=artifacts/named_verdict_streams/adapter \
                --layer $E/trec_verdict_probe.yaml --split train --check trained --gain 0.08 \
                --output runs/s37/ceiling.json || exit 1
            [[ -f runs/s37/probe-banking77.json ]] || probe_banking77 artifacts/named_verdict_streams/adapter \
                runs/s37/probe-banking77.json
            [[ -f runs/s37/probe.json ]] || probe artifacts/named_verdict_streams/adapter runs/s37/probe.json
            if ! grep -q '"verdict": "passed"' runs/s37/ceiling.json; then
                echo "== check L54 failed: setting 37 stops here (addendum 60)"; exit 0
            fi
            gate_naive_two_seeds 37 || exit 1 ;;
        l55)  # addendum 61: no training
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            restore_kept named_verdict_streams artifacts/named_verdict_streams/adapter || exit 1
            mkdir -p runs/l55
            [[ -f runs/l55/ceiling-six.json ]] || verdict_probe_six "check L55" runs/l55/ceiling-six.json \
                bootstrap=artifacts/bootstrap/adapter trained=artifacts/named_verdict_streams/adapter || exit 1 ;;
        s38)  # addendum 61: only if gate N37 failed; check L55 chooses the branch
            if ! gate_failed 37; then
                echo "run.sh s38: setting 38 runs only after gate N37 failed (collect it into results.json first)" >&2
                exit 2
            fi
            if [[ ! -f runs/l55/ceiling-six.json ]]; then
                echo "run.sh s38: setting 38's branch comes from check L55 (run l55 first)" >&2
                exit 2
            fi
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            restore_kept named_verdict_streams artifacts/named_verdict_streams/adapter || exit 1
            S38=("${NAMED_VERDICT[@]}" -c $E/six_verdict_streams.yaml)
            mkdir -p runs/s38
            if grep -q '"verdict": "failed"' runs/l55/ceiling-six.json; then  # branch "six gap"
                trained six_verdict_streams || step s38 "$ICRL" stage ppo "${SKILL[@]}" "${S38[@]}" || exit 1
                [[ -f runs/s38/ceiling-six.json ]] || verdict_probe_six "check L56" runs/s38/ceiling-six.json \
                    bootstrap=artifacts/bootstrap/adapter trained=artifacts/six_verdict_streams/adapter || exit 1
                [[ -f runs/s38/ceiling.json ]] || step "setting 38, 2 labels" .venv/bin/python \
                    $E/class_verdict_ceiling.py trained=artifacts/six_verdict_streams/adapter \
                    --layer $E/trec_verdict_probe.yaml --split train --decide trained \
                    --output runs/s38/ceiling.json || exit 1
                adapter=artifacts/six_verdict_streams/adapter
            else  # branch "six carries"
                trained long_verdict_streams || step s38 "$ICRL" stage ppo "${SKILL[@]}" "${S38[@]}" \
                    -c $E/long_verdict_streams.yaml || exit 1
                adapter=artifacts/long_verdict_streams/adapter
            fi
            [[ -f runs/s38/probe-banking77.json ]] || probe_banking77 $adapter runs/s38/probe-banking77.json
            [[ -f runs/s38/probe.json ]] || probe $adapter runs/s38/probe.json
            if [[ -f runs/s38/ceiling-six.json ]] && ! grep -q '"verdict": "passed"' runs/s38/ceiling-six.json; then
                echo "== check L56 failed: setting 38 stops here (addendum 61)"; exit 0
            fi
            gate_naive_two_seeds 38 --set "evaluate.adapter=$adapter" || exit 1 ;;
        probe-banking77-bootstrap)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            probe_banking77 artifacts/bootstrap/adapter runs/bootstrap/probe-banking77.json ;;
        s[0-9][0-9]-gate2-*)
            setting_output "${target:1:2}" "$target" || exit 2
            gate2_part "${target:1:2}" "$output" "$target" || exit 1 ;;
        s[0-9][0-9]-forgetting)
            setting_output "${target:1:2}" "$target" || exit 2
            setting_adapter "$output" || exit 1
            forgetting "artifacts/$output/adapter" "runs/${target%-forgetting}/forgetting.json" ;;
        s16)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained burn_in_streams || step s16 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml
            step "gate E16" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml -c $E/gate_explorative_long.yaml
            probe artifacts/burn_in_streams/adapter runs/s16/probe.json ;;
        s17)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            restore_kept burn_in_streams artifacts/burn_in_streams/adapter || exit 1
            trained burn_in_streams_more || step s17 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/burn_in_streams_more.yaml
            step "gate E17" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml -c $E/gate_explorative_long.yaml \
                -c $E/gate_explorative_s17.yaml
            probe artifacts/burn_in_streams_more/adapter runs/s17/probe.json ;;
        s18)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained naive_burn_in || step s18 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/naive_burn_in.yaml
            step "gate N18" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml -c $E/gate_naive_s18.yaml
            probe artifacts/naive_burn_in/adapter runs/s18/probe.json ;;
        s19)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained test_reward_streams || step s19 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/test_reward_streams.yaml
            step "gate E19" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml -c $E/gate_explorative_long.yaml \
                -c $E/gate_explorative_s19.yaml
            probe artifacts/test_reward_streams/adapter runs/s19/probe.json ;;
        s20)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained six_label_streams || step s20 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/six_label_streams.yaml
            step "gate E20" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml -c $E/gate_explorative_long.yaml \
                -c $E/gate_explorative_s20.yaml
            probe artifacts/six_label_streams/adapter runs/s20/probe.json ;;
        s21)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained many_label_streams || step s21 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/many_label_streams.yaml
            gate_two_seeds 21
            restore_kept burn_in_streams artifacts/burn_in_streams/adapter || exit 1
            step "setting 16 at seed 8" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml \
                -c $E/gate_explorative_long.yaml --set icrl_eval.seed=8 \
                --set evaluate.output_dir=artifacts/gate_explorative_s16_seed8
            probe artifacts/many_label_streams/adapter runs/s21/probe.json ;;
        s22)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained wide_group_streams || step s22 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/many_label_streams.yaml \
                -c $E/wide_group_streams.yaml
            gate_two_seeds 22
            probe artifacts/wide_group_streams/adapter runs/s22/probe.json ;;
        s26)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained discovery_streams || step s26 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/discovery_streams.yaml
            gate_two_seeds 26
            probe artifacts/discovery_streams/adapter runs/s26/probe.json ;;
        s34)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained closure_streams || step s34 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/closure_streams.yaml
            closure_check 34 setting34=artifacts/closure_streams/adapter setting26=$E/adapters/discovery_streams \
                || exit 0
            gate_two_seeds 34 || exit 1
            probe artifacts/closure_streams/adapter runs/s34/probe.json ;;
        s35)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            trained named_closure_streams || step s35 "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/explorative_streams.yaml -c $E/burn_in_streams.yaml -c $E/closure_streams.yaml \
                -c $E/named_closure_streams.yaml
            # addendum 57: setting 34's adapter (it decides nothing) is probed beside it only when it is there
            beside=()
            trained closure_streams && beside=(setting34=artifacts/closure_streams/adapter)
            closure_check 35 setting35=artifacts/named_closure_streams/adapter "${beside[@]}" || exit 0
            gate_two_seeds 35 || exit 1
            probe artifacts/named_closure_streams/adapter runs/s35/probe.json ;;
        s23|s24|s25)
            output=${SETTING_OUTPUT[${target:1:2}]}
            derived "$output" || exit 1
            gate_two_seeds "${target:1:2}"
            probe "artifacts/$output/adapter" "runs/$target/probe.json" ;;
        ablation-ppo|ablation-grpo|ablation-rloo)
            arm=${target#ablation-}
            trained "ablation_$arm" || step "$target" "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml \
                -c $E/ablation_streams.yaml -c "$E/ablation_$arm.yaml" --set model.share_prefix=true
            probe "artifacts/ablation_$arm/adapter" "runs/$target/probe.json" ;;
        ablation-dpo_rank)
            trained ablation_dpo_rank || step "$target" "$ICRL" stage dpo "${SKILL[@]}" -c $E/hindsight_dpo.yaml \
                -c $E/one_stage_rank_replay.yaml -c $E/ablation_dpo_rank.yaml --set model.share_prefix=true
            probe artifacts/ablation_dpo_rank/adapter "runs/$target/probe.json" ;;
        probe-bootstrap)
            probe artifacts/bootstrap/adapter runs/bootstrap/probe.json ;;
        cd-plain|cd-distill)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            arm=${target#cd-}
            extra=()
            [[ $arm == distill ]] && extra=(-c $E/stream_rl_distill.yaml)
            trained "cd_$arm" || step "$target" "$ICRL" stage ppo "${SKILL[@]}" -c $E/stream_rl.yaml "${extra[@]}" \
                --set "ppo.output_dir=artifacts/cd_$arm"
            probe "artifacts/cd_$arm/adapter" "runs/$target/probe.json"
            forgetting "artifacts/cd_$arm/adapter" "runs/$target/forgetting.json" ;;
        cd-eval-*)
            restore_kept bootstrap_h32 artifacts/bootstrap/adapter || exit 1
            part=${target#cd-eval-}
            seed=${part%%-*} arm=${part#*-}
            restore_kept "cd_$arm" "artifacts/cd_$arm/adapter" || exit 1
            step "$target" "$ICRL" stage evaluate "${SKILL[@]}" -c $E/gate2.yaml --set "icrl_eval.seed=$seed" \
                --set "evaluate.adapter=artifacts/cd_$arm/adapter" --set "evaluate.strategies=[naive]" \
                --set "evaluate.output_dir=artifacts/cd_eval/seed$seed-$arm" ;;
        final-*)
            task=${target#final-}
            if [[ " $FINAL_TASKS " != *" $task "* ]]; then
                echo "run.sh: '$target': the final tests are final-{${FINAL_TASKS// /,}}" >&2
                exit 2
            fi
            restore_kept recipe_bootstrap artifacts/recipe_bootstrap/adapter || exit 1
            restore_kept recipe_rl artifacts/recipe_rl/adapter || exit 1
            step "$target" "$ICRL" stage evaluate "${RECIPE[@]}" -c $E/final_tests.yaml --set "icrl_eval.task=$task" \
                --set "evaluate.output_dir=artifacts/final_tests/$task" ;;
        park)
            park ;;
        *)
            echo "run.sh: unknown target '$target' (bootstrap, s14, s15, s15-gate2-SEED-STRATEGY, s15-forgetting," \
                 "s16, s16-gate2-SEED-STRATEGY, s16-forgetting, s17, s17-gate2-SEED-STRATEGY, s17-forgetting," \
                 "s18, s18-gate2-SEED-STRATEGY, s18-forgetting, s19, s19-gate2-SEED-STRATEGY, s19-forgetting," \
                 "s20, s20-gate2-SEED-STRATEGY, s20-forgetting, s21, s21-gate2-SEED-STRATEGY, s21-forgetting," \
                 "s22, s22-gate2-SEED-STRATEGY, s22-forgetting, s23, s23-gate2-SEED-STRATEGY, s23-forgetting," \
                 "s24, s24-gate2-SEED-STRATEGY, s24-forgetting, s25, s25-gate2-SEED-STRATEGY, s25-forgetting," \
                 "s26, s26-gate2-SEED-STRATEGY, s26-forgetting, s27-start, s27, s27-gate2-SEED-STRATEGY," \
                 "s27-forgetting, s28, s28-gate2-SEED-STRATEGY, s28-forgetting, s29, s29-gate2-SEED-STRATEGY," \
                 "s29-forgetting, s30, s30-gate2-SEED-STRATEGY, s30-forgetting, s31, s31-gate2-SEED-STRATEGY," \
                 "s31-forgetting, s32, s32-gate2-SEED-STRATEGY, s32-forgetting, s33, s33-gate2-SEED-STRATEGY," \
                 "s33-forgetting, s34, s34-gate2-SEED-STRATEGY, s34-forgetting, s35, s35-gate2-SEED-STRATEGY," \
                 "s35-forgetting, probe-banking77-bootstrap, l48, l49, l50," \
                 "ablation-{ppo,grpo,rloo,dpo_rank}, probe-bootstrap, cd-{plain,distill}, cd-eval-SEED-ARM, final-TASK, park)" >&2
            exit 2 ;;
    esac
done
