#!/bin/bash
# Run: bash slurm/pipeline.sh [Hydra overrides passed to every stage]
#   EXPERIMENT=demo bash slurm/pipeline.sh
#   EXPERIMENT=smoke GPUS_PER_NODE=0 CPUS_PER_TASK=1 DISTILL_TASKS=2 bash slurm/pipeline.sh   (CPU-only, minutes)
#   HEAD_ARGS="model.block_size=8" REGIMES="distill both" bash slurm/pipeline.sh paths.artifacts=/scratch/bpd
# Submits the whole experiment as SLURM jobs chained with --dependency=afterok and prints their ids:
#   base training -> distillation corpus (slurm/distill.sbatch: job array, then verify)
#   -> head regimes (frozen and finetune need only the base model; distill and both wait for the corpus)
#   -> evaluate (slurm/evaluate.sbatch: every run of the corpus) -> export (the bundle with its eval table).
# A failed stage cancels every stage after it (--kill-on-invalid-dep=yes). To go on from a finished stage,
# submit only the rest, e.g. STAGES="heads evaluate export" (the skipped stages' artifacts must exist).
# Logs: $LOG_DIR/<job name>-<job id>.out. Jobs run in the repository root with .venv/bin/python (or $PYTHON).
#
# Edit these (or set them in the environment):
PARTITION=${PARTITION:-}          # e.g. gpu; empty = the cluster's default partition
ACCOUNT=${ACCOUNT:-}              # e.g. my-project; empty = none
GPUS_PER_NODE=${GPUS_PER_NODE:-8} # training: one task per GPU; distill/evaluate: 1 GPU per task. 0 = CPU-only (no gres)
NODES=${NODES:-1}                 # training nodes
CPUS_PER_TASK=${CPUS_PER_TASK:-8}
STRATEGY=${STRATEGY:-}            # training strategy (conf/strategy/): empty = ddp with several tasks
EXPERIMENT=${EXPERIMENT:-}        # smoke | demo | empty (full size); added as experiment=... to every stage
REGIMES=${REGIMES:-frozen finetune distill both}
DISTILL_TASKS=${DISTILL_TASKS:-8} # job array size for the distillation corpus
STAGES=${STAGES:-base distill heads evaluate export}
TRAIN_TIME=${TRAIN_TIME:-24:00:00}     # per job; training requeues itself before the limit and resumes
DISTILL_TIME=${DISTILL_TIME:-04:00:00}
EVAL_TIME=${EVAL_TIME:-04:00:00}
EXPORT_TIME=${EXPORT_TIME:-00:30:00}
# Extra Hydra overrides for one stage only (split on spaces):
BASE_ARGS=${BASE_ARGS:-}  HEAD_ARGS=${HEAD_ARGS:-}  DISTILL_ARGS=${DISTILL_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}  EXPORT_ARGS=${EXPORT_ARGS:-}
LOG_DIR=${LOG_DIR:-logs}
set -euo pipefail

cd "$(dirname "$0")/.."
mkdir -p "$LOG_DIR"
common=()
[[ -n "$EXPERIMENT" ]] && common+=("experiment=$EXPERIMENT")
common+=("$@")
read -r -a base_args <<<"$BASE_ARGS"
read -r -a head_args <<<"$HEAD_ARGS"
read -r -a distill_args <<<"$DISTILL_ARGS"
read -r -a eval_args <<<"$EVAL_ARGS"
read -r -a export_args <<<"$EXPORT_ARGS"
PY=${PYTHON:-}
[[ -z "$PY" && -x .venv/bin/python ]] && PY=$PWD/.venv/bin/python
PY=${PY:-python}

account=()
[[ -n "$PARTITION" ]] && account+=(--partition="$PARTITION")
[[ -n "$ACCOUNT" ]] && account+=(--account="$ACCOUNT")
# shellcheck disable=SC2054  # (the comma in --export=ALL,... is meant)
train_res=(--nodes="$NODES" --cpus-per-task="$CPUS_PER_TASK" --time="$TRAIN_TIME" --export=ALL,STRATEGY="$STRATEGY")
gpu_task=()
if [[ "$GPUS_PER_NODE" -gt 0 ]]; then
  train_res+=(--ntasks-per-node="$GPUS_PER_NODE" --gpus-per-node="$GPUS_PER_NODE")
  gpu_task=(--gpus-per-task=1)
else
  train_res+=(--ntasks-per-node=1)
fi

names=() ids=()
want() { [[ " $STAGES " == *" $1 "* ]]; }
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
  printf '%-15s %s\n' "$name" "$JID"
}

echo "bpd-train pipeline: stages [$STAGES], regimes [$REGIMES], overrides [${common[*]}]"
base="" verify=""
if want base; then
  submit base --job-name=bpd-base "${train_res[@]}" --output="$LOG_DIR/%x-%j.out" \
    slurm/train.sbatch +regime=base "${common[@]}" "${base_args[@]}"
  base=$JID
fi

needs_corpus=0
for r in $REGIMES; do [[ "$r" == distill || "$r" == both ]] && needs_corpus=1; done
if want distill && [[ $needs_corpus == 1 ]]; then
  mapfile -t dep < <(after "$base")
  submit distill-array --job-name=bpd-distill --array="0-$((DISTILL_TASKS - 1))" --cpus-per-task="$CPUS_PER_TASK" \
    --time="$DISTILL_TIME" "${gpu_task[@]}" "${dep[@]}" --output="$LOG_DIR/%x-%A_%a.out" \
    slurm/distill.sbatch "${common[@]}" "${distill_args[@]}"
  mapfile -t dep < <(after "$JID")
  submit distill-verify --job-name=bpd-distill-verify --cpus-per-task="$CPUS_PER_TASK" --time="$DISTILL_TIME" \
    "${dep[@]}" --export=ALL,DISTILL_ACTION=verify --output="$LOG_DIR/%x-%j.out" \
    slurm/distill.sbatch "${common[@]}" "${distill_args[@]}"
  verify=$JID
fi

heads=()
if want heads; then
  for r in $REGIMES; do
    if [[ "$r" == distill || "$r" == both ]]; then mapfile -t dep < <(after "$base" "$verify")
    else mapfile -t dep < <(after "$base"); fi
    submit "$r" --job-name="bpd-$r" "${train_res[@]}" "${dep[@]}" --output="$LOG_DIR/%x-%j.out" \
      slurm/train.sbatch "+regime=$r" "${common[@]}" "${head_args[@]}"
    heads+=("$JID")
  done
fi

evaluate=""
if want evaluate; then
  eval_gpu=()
  [[ "$GPUS_PER_NODE" -gt 0 ]] && eval_gpu=(--gpus-per-node=1)
  mapfile -t dep < <(after "$base" "${heads[@]}")
  submit evaluate --job-name=bpd-evaluate --cpus-per-task="$CPUS_PER_TASK" --time="$EVAL_TIME" \
    "${eval_gpu[@]}" "${dep[@]}" --output="$LOG_DIR/%x-%j.out" \
    slurm/evaluate.sbatch "${common[@]}" "${eval_args[@]}"
  evaluate=$JID
fi

if want export; then
  mapfile -t dep < <(after "$base" "${heads[@]}" "$evaluate")
  cmd=$(printf '%q ' "$PY" export.py "${common[@]}" "${export_args[@]}")
  submit export --job-name=bpd-export --cpus-per-task=1 --time="$EXPORT_TIME" "${dep[@]}" \
    --output="$LOG_DIR/%x-%j.out" --wrap="cd $(printf %q "$PWD") && exec $cmd"
fi

echo "jobs: $(for i in "${!ids[@]}"; do printf '%s=%s ' "${names[$i]}" "${ids[$i]}"; done)"
echo "logs: $LOG_DIR/bpd-<stage>-<job id>.out   queue: squeue --me   cancel all: scancel ${ids[*]:-}"
