#!/bin/bash
# Run: bash slurm/pipeline.sh [Hydra overrides passed to every stage]
#   EXPERIMENT=demo bash slurm/pipeline.sh                      (make demo's stages, on the cluster)
#   EXPERIMENT=smoke GPUS_PER_NODE=0 CPUS_PER_TASK=1 DISTILL_TASKS=2 bash slurm/pipeline.sh   (CPU-only, minutes)
#   K=8 REGIMES="distill both" bash slurm/pipeline.sh paths.artifacts=/scratch/bpd
# Submits `make demo`'s stages as SLURM jobs chained with --dependency=afterok and prints their ids. The stages,
# their order and what each waits for come from the pipeline itself (python -m bpd_train.pipeline --print-stages:
# base -> [teacher] -> teacher's distillation corpus -> head regimes -> [self-distill -> self] -> evaluate ->
# export of the best run); each job runs `python -m bpd_train.pipeline ... --stage NAME --launcher slurm`, which
# skips a complete stage and otherwise runs its command through slurm/train.sbatch (one task per GPU, requeue on
# SIGUSR1), slurm/distill.sbatch (a job array, then a verify job) or slurm/evaluate.sbatch inside the job.
# A failed stage cancels every stage after it (--kill-on-invalid-dep=yes). To go on from finished stages, rerun
# the whole script (complete stages finish at once) or submit only some, e.g. STAGES="heads evaluate export"
# (groups: base teacher distill heads evaluate export, or stage names).
# Logs: $LOG_DIR/<job name>-<job id>.out. Jobs run in the repository root with .venv/bin/python (or $PYTHON).
#
# Edit these (or set them in the environment):
PARTITION=${PARTITION:-}          # e.g. gpu; empty = the cluster's default partition
ACCOUNT=${ACCOUNT:-}              # e.g. my-project; empty = none
GPUS_PER_NODE=${GPUS_PER_NODE:-8} # training: one task per GPU; distill/evaluate: 1 GPU per task. 0 = CPU-only (no gres)
NODES=${NODES:-1}                 # training nodes
CPUS_PER_TASK=${CPUS_PER_TASK:-8}
STRATEGY=${STRATEGY:-}            # training strategy (conf/strategy/): empty = ddp with several tasks
EXPERIMENT=${EXPERIMENT:-}        # smoke | demo | empty (full size): the pipeline's --experiment
REGIMES=${REGIMES:-}              # e.g. "frozen both"; empty = the experiment's pipeline.regimes (as make demo)
K=${K:-4}                         # block size of the heads runs
DISTILL_TASKS=${DISTILL_TASKS:-8} # job array size for the distillation corpus
STAGES=${STAGES:-base teacher distill heads evaluate export}
TRAIN_TIME=${TRAIN_TIME:-24:00:00}     # per job; training requeues itself before the limit and resumes
DISTILL_TIME=${DISTILL_TIME:-04:00:00}
EVAL_TIME=${EVAL_TIME:-04:00:00}
EXPORT_TIME=${EXPORT_TIME:-00:30:00}
# Overrides for one regime's stage only: pipeline.regime_overrides={both: [steps.heads=1000]} (conf/train.yaml)
LOG_DIR=${LOG_DIR:-logs}
set -euo pipefail

cd "$(dirname "$0")/.."
mkdir -p "$LOG_DIR"
PY=${PYTHON:-}
[[ -z "$PY" && -x .venv/bin/python ]] && PY=$PWD/.venv/bin/python
PY=${PY:-python}

account=()
[[ -n "$PARTITION" ]] && account+=(--partition="$PARTITION")
[[ -n "$ACCOUNT" ]] && account+=(--account="$ACCOUNT")
# shellcheck disable=SC2054  # (the comma in --export=ALL,... is meant)
train_res=(--nodes="$NODES" --cpus-per-task="$CPUS_PER_TASK" --time="$TRAIN_TIME" --export=ALL,STRATEGY="$STRATEGY"
           --signal=SIGUSR1@120 --requeue --open-mode=append)  # slurm/train.sbatch's #SBATCH lines
gpu_task=()
if [[ "$GPUS_PER_NODE" -gt 0 ]]; then
  train_res+=(--ntasks-per-node="$GPUS_PER_NODE" --gpus-per-node="$GPUS_PER_NODE")
  gpu_task=(--gpus-per-task=1)
else
  train_res+=(--ntasks-per-node=1)
fi

pipeline=(-m bpd_train.pipeline --experiment "${EXPERIMENT:-none}" --k "$K")
[[ -n "$REGIMES" ]] && pipeline+=(--regimes "${REGIMES// /,}")
pipeline+=("$@")
# name kind after,after (or -), one line per stage, in order
plan=$("$PY" "${pipeline[@]}" --print-stages) || { echo "pipeline: cannot plan the stages (see above)" >&2; exit 2; }

names=() ids=()
declare -A job=()
group() {  # the STAGES group a stage belongs to
  case $1 in base|teacher|evaluate|export) echo "$1" ;; distill-corpus|self-distill) echo distill ;; *) echo heads ;; esac
}
want() { [[ " $STAGES " == *" $1 "* || " $STAGES " == *" $(group "$1") "* ]]; }
after() {  # after ID... -> --dependency=afterok:ID:ID (nothing when no ids)
  local d=() i
  for i in "$@"; do [[ -n "$i" ]] && d+=("$i"); done
  [[ ${#d[@]} -gt 0 ]] && printf -- "--dependency=afterok:%s\n--kill-on-invalid-dep=yes\n" "$(IFS=:; echo "${d[*]}")"
  return 0
}
submit() {  # submit NAME sbatch-args... -> sets JID, records it
  local name=$1 out
  shift
  if ! out=$(sbatch --parsable "${account[@]}" "$@"); then
    echo "pipeline: submitting $name failed; already submitted: ${ids[*]:-none}" >&2
    [[ ${#ids[@]} -gt 0 ]] && echo "  cancel them with: scancel ${ids[*]}" >&2
    exit 1
  fi
  JID=${out%%;*}
  names+=("$name") ids+=("$JID")
  printf '%-22s %s\n' "$name" "$JID"
}
wrap() {  # the job's command: this stage of the pipeline, run inside the job
  printf 'cd %q && exec' "$PWD"
  printf ' %q' "$PY" "${pipeline[@]}" --stage "$1" --launcher slurm
}

echo "bpd-train pipeline: stages [$STAGES], experiment [${EXPERIMENT:-none}], k=$K, overrides [$*]"
while read -r name kind deps; do
  want "$name" || continue
  wait_for=()
  if [[ "$deps" != - ]]; then
    IFS=, read -r -a d <<<"$deps"
    for s in "${d[@]}"; do wait_for+=("${job[$s]:-}"); done  # a stage not submitted now: its artifact must exist
  fi
  mapfile -t dep < <(after "${wait_for[@]}")
  out=(--output="$LOG_DIR/%x-%j.out")
  case $kind in
    train)
      submit "$name" --job-name="bpd-$name" "${train_res[@]}" "${dep[@]}" "${out[@]}" --wrap="$(wrap "$name")" ;;
    distill)  # a job array of workers, then one job that verifies the corpus and marks it complete
      submit "$name-array" --job-name="bpd-$name" --array="0-$((DISTILL_TASKS - 1))" --cpus-per-task="$CPUS_PER_TASK" \
        --time="$DISTILL_TIME" "${gpu_task[@]}" "${dep[@]}" --output="$LOG_DIR/%x-%A_%a.out" --wrap="$(wrap "$name")"
      mapfile -t vdep < <(after "$JID")
      submit "$name-verify" --job-name="bpd-$name-verify" --cpus-per-task="$CPUS_PER_TASK" --time="$DISTILL_TIME" \
        "${vdep[@]}" --export=ALL,DISTILL_ACTION=verify "${out[@]}" --wrap="$(wrap "$name")" ;;
    evaluate)
      eval_gpu=()
      [[ "$GPUS_PER_NODE" -gt 0 ]] && eval_gpu=(--gpus-per-node=1)
      submit "$name" --job-name="bpd-$name" --cpus-per-task="$CPUS_PER_TASK" --time="$EVAL_TIME" "${eval_gpu[@]}" \
        "${dep[@]}" "${out[@]}" --wrap="$(wrap "$name")" ;;
    export)
      submit "$name" --job-name="bpd-$name" --cpus-per-task=1 --time="$EXPORT_TIME" "${dep[@]}" "${out[@]}" \
        --wrap="$(wrap "$name")" ;;
    *) echo "pipeline: stage $name has an unknown kind $kind" >&2; exit 2 ;;
  esac
  job[$name]=$JID
done <<<"$plan"

echo "jobs: $(for i in "${!ids[@]}"; do printf '%s=%s ' "${names[$i]}" "${ids[$i]}"; done)"
echo "logs: $LOG_DIR/bpd-<stage>-<job id>.out   queue: squeue --me   cancel all: scancel ${ids[*]:-}"
