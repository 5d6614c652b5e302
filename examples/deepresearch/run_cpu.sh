#!/usr/bin/env bash
# The DeepResearch CPU recipe, end to end on a 2-core machine with no GPU and no download:
#   1. the knowledge base, the ~3.5M-parameter model and the SFT transcripts over fresh worlds
#      (prepare.py);
#   2. supervised warm start with `lockgate sft`: copy drills (the model learns to copy a name),
#      then one pass over the oracle's transcripts (it learns to search, read and answer). Two
#      gates: the drills must copy (held-out exact match, configs/drill_cpu.yaml), and the SFT
#      model must answer validation questions over a world of its own and search 2-hop ones
#      twice (gate.py, which continues SFT a chunk at a time within a cap). A gate missed stops
#      the recipe here with one line,
#      `[deepresearch] stage 2 (...): <reason>`, instead of at the final evaluation;
#   3. held-out evaluation of the SFT model, with the oracle and no-search baselines;
#   4. fully-async GRPO through the gateway with `lockgate train` (32 steps, greedy validation
#      every 8);
#   5. held-out evaluation of the RL model, the report's plots, and the before -> after lines.
# Steps 3-5 share one set of vLLM replicas (`lockgate replicas`, started on the SFT model): RL
# syncs its weights into them, and step 5 evaluates the weights of RL's last step there. Each
# replica start costs ~40 s of the 2 cores.
# SEED=1 ./examples/deepresearch/run_cpu.sh runs another seed (SFT and RL); extra arguments go
# to `lockgate train` (e.g. --set loop.steps=5). For tests and quick looks, each stage takes
# extra arguments from the environment (shell words): PREPARE_ARGS (prepare.py), DRILL_ARGS and
# SFT_ARGS (`lockgate sft`), GATE_ARGS (gate.py; after its `--`, evaluate.py's); DATA and RUN
# move the data and the run; SKIP_SETUP=1 leaves .venv as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
SEED=${SEED:-0}
# Absolute, so that every stage's paths hold wherever a command resolves them.
DATA=$(realpath -m "${DATA:-runs/deepresearch/data/seed$SEED}")
RUN=$(realpath -m "${RUN:-runs/deepresearch/seed$SEED}")
eval "prepare_args=(${PREPARE_ARGS:-})"
eval "drill_args=(${DRILL_ARGS:-})"
eval "sft_args=(${SFT_ARGS:-})"
# 200 validation questions, one episode each at T=1, as many in flight as the evaluations.
eval "gate_args=(${GATE_ARGS:--- --concurrency 160})"
PY=.venv/bin/python
LG=.venv/bin/lockgate
MOD=lockgate.examples.deepresearch
say() { echo "[deepresearch] $*" >&2; }

[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
mkdir -p "$RUN"
started=$(date +%s)
say "1/5 knowledge base, model and SFT transcripts in $DATA"
# sets model=, kb=, val_kb=, ...
eval "$($PY -m $MOD.prepare --out "$DATA" --transcript-seed "$SEED" "${prepare_args[@]}")"

say "2/5 supervised warm start (lockgate sft: copy drills, then transcripts) -> $RUN/drill, $RUN/sft"
sft() {  # CONFIG DATA_NAME FROM_MODEL OUT [more lockgate sft arguments]
  rm -f "$RUN/$4/failed"
  $LG sft "examples/deepresearch/configs/$1" --set "model.path=$3" \
    --set "data.path=$DATA/$2_train.jsonl" --set "data.val_path=$DATA/$2_val.jsonl" \
    --set "out_dir=$RUN/$4" --set "trainer.seed=$SEED" "${@:5}"
}
stopped() {  # STAGE LINE: a gate missed or a stage failed; the recipe ends here
  say "$1: $2"
  exit 1
}
# A failed `lockgate sft` leaves its one-line reason in OUT/failed (the drills' gate among them).
why_sft() { paste -sd' ' "$1/failed" 2>/dev/null || echo "lockgate sft failed (its line is above)"; }
sft drill_cpu.yaml drill "$model" drill "${drill_args[@]}" \
  || stopped "stage 2 (copy drills)" "$(why_sft "$RUN/drill")"
sft sft_cpu.yaml sft "$RUN/drill/final" sft "${sft_args[@]}" \
  || stopped "stage 2 (SFT)" "$(why_sft "$RUN/sft")"
say "2/5 SFT gate: the SFT model on validation questions over a world of their own -> $RUN/gate"
why=$($PY -m $MOD.gate --sft-out "$RUN/sft" --kb-dir "$val_kb" --work "$RUN/gate" \
  "${gate_args[@]}") || stopped "stage 2 (SFT)" "$why"
SFT_MODEL="$RUN/sft/final"

say "3/5 held-out evaluation of the SFT model (T=1, greedy, oracle, no search)"
mkdir -p "$RUN/replicas"
# As many replicas as the CPU plan gives this machine's cores (2 on 2 cores).
NREP=$($PY -c "from lockgate.coordinator.cpu_plan import plan_here; print(plan_here().replicas)")
$LG replicas --set "model.path=$SFT_MODEL" --set replicas.count="$NREP" \
  --set replicas.max_model_len=2048 --run-dir "$RUN/replicas" >"$RUN/replicas/urls" &
replicas_pid=$!
trap 'kill $replicas_pid 2>/dev/null; wait $replicas_pid 2>/dev/null || true' EXIT
until [ "$(grep -c '^replica_url=' "$RUN/replicas/urls")" = "$NREP" ]; do
  kill -0 $replicas_pid 2>/dev/null || { say "the replicas did not start"; exit 1; }
  sleep 1
done
mapfile -t REPLICAS < <(sed -n 's/^replica_url=//p' "$RUN/replicas/urls")
# Eight episodes per question at T=1 (one greedy): two evaluations of one model with four
# each differed by up to 3.8 points, as much as the change to be measured (EXPERIMENTS.md).
# 160 episodes in flight: the 1,600 T=1 episodes of one model took 96 s against 106 s at 96 (on
# running replicas; at 96, 181 and 154 s with the start against 247 and 189 s at 32).
EVAL=(--kb-dir "$kb" --samples 8 --concurrency 160 --replica-urls "${REPLICAS[@]}")
$PY -m $MOD.evaluate run --model "$SFT_MODEL" "${EVAL[@]}" --out "$RUN/eval_sft.json" \
  --oracle --no-search

say "4/5 fully-async GRPO (lockgate train) -> $RUN/rl"
# The replicas are given, not started by the run, so say that they are local and share the 2
# cores with the trainer, which gets the CPU first (coordinator/launch/cpu_priority.py).
urls=$(IFS=,; echo "${REPLICAS[*]}")
$LG train examples/deepresearch/configs/rl_cpu.yaml --run-dir "$RUN/rl" --set "seed=$SEED" \
  --set "model.path=$SFT_MODEL" --set "environment.args.kb_dir=$kb" \
  --set "replicas.urls=[$urls]" --set trainer_first=true "$@"

say "5/5 held-out evaluation of the RL model"
last=$(ls -d "$RUN"/rl/trainer/weights/step_* | sort -t_ -k2 -n | tail -1)
rm -rf "$RUN/rl_final"
$LG export-hf "$last" "$RUN/rl_final" >/dev/null
$PY -m $MOD.evaluate run --model "$RUN/rl_final" "${EVAL[@]}" --out "$RUN/eval_rl.json" \
  --expect-weight-version "${last##*_}"
$LG report "$RUN/rl" >/dev/null
say "done in $(( ($(date +%s) - started) / 60 )) min; plots in $RUN/rl/report/"
$PY -m $MOD.evaluate compare "$RUN/eval_sft.json" "$RUN/eval_rl.json"
