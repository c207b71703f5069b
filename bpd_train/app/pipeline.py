"""The whole BPD experiment in miniature, one stage after another: `make demo` runs this.

python -m bpd_train.pipeline --experiment demo [--k 4] [--regimes frozen,finetune,distill,both,self] [EXTRA=OVERRIDES ...]
python -m bpd_train.pipeline ... --print-stages      (the stage list: name, kind, the stages it waits for)
python -m bpd_train.pipeline ... --stage NAME [--launcher slurm]   (one stage; what slurm/pipeline.sh's jobs run)

tokenizer -> base model -> [teacher model] -> teacher beam-search distillation corpus -> heads in each regime at
block size k (`self`: after a corpus of its init_from model's own greedy output)
-> evaluation (report.md, plots) -> export of the best run: the fastest exact run whose BLEU is within
evaluate.max_bleu_drop (1.0) of the base model's greedy BLEU, else the base model itself. Each stage runs its
own entry point as a subprocess (exactly what a user would type) and is skipped when its artifact is already
complete, so a rerun after a crash or Ctrl-C resumes where it stopped; a training run that was cut short
resumes from its last.ckpt.

The driver's own settings are the `pipeline:` section of the train config (conf/train.yaml; experiments set them,
`pipeline.KEY=VALUE` on this command line too; they are not passed on to the stages).
The teacher: by default the base model itself. An experiment that sets `pipeline.teacher_steps: N` (the demo does)
gets a stronger teacher, as in the paper (a bigger model there): the base run trained on to N steps in its own run
folder (<corpus>/teacher; the same run resumed, so it shares the base's first steps and costs only the extra ones).
The heads regimes still start from the base model; `distill` and `both` learn from the teacher's beam output, and
the report compares every run with the teacher. `self` (where `pipeline.regimes` or --regimes lists it) starts from
the base, or from the run of `pipeline.self_from`, and trains on that model's own greedy output (the demo: from
`both`, the whole model with head 1 at half of the loss, through `pipeline.regime_overrides.self`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpd_train.configs import INSTALLED, REPO_ROOT
from bpd_train.data.distilled import DistillError, read_manifest

HEAD_REGIMES = ("frozen", "finetune", "distill", "both", "self")
PAPER_REGIMES = HEAD_REGIMES[:4]  # the default; `self` (not in the paper) where an experiment lists it


def compose(config_name: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


# Where a stage's command runs: here, as a subprocess (make demo), or, in a SLURM stage job (slurm/pipeline.sh),
# through the entry point's sbatch file in its inside-the-job mode (srun, one task per GPU), which replaces this process.
SBATCH = {
    "train.py": "slurm/train.sbatch",
    "distill.py": "slurm/distill.sbatch",
    "evaluate.py": "slurm/evaluate.sbatch",
}
LAUNCHER = "local"


def run_stage(name: str, argv: list[str]) -> None:
    if LAUNCHER == "slurm":
        print(f"=== {name}: {' '.join(argv)}", flush=True)
        script = SBATCH.get(argv[0])
        cmd = ["bash", script, *argv[1:]] if script else [sys.executable, *argv]
        os.chdir(REPO_ROOT)
        os.execvp(cmd[0], cmd)
    cmd = [sys.executable, *argv]
    if INSTALLED:  # no train.py beside an installed package: the same commands, from the package
        cmd = [sys.executable, "-m", "bpd_train.app.commands", argv[0].removesuffix(".py"), *argv[1:]]
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=None if INSTALLED else REPO_ROOT)
    if proc.returncode != 0:
        sys.exit(
            f"stage '{name}' failed (exit {proc.returncode}); fix the error above and rerun — "
            f"finished stages are skipped"
        )
    print(f"=== {name}: done in {time.monotonic() - t0:.0f} s", flush=True)


def train_stage(regime: str, common: list[str], k: int, name: str | None = None) -> Path:
    overrides = [f"+regime={regime}", *common] + ([f"model.block_size={k}"] if regime != "base" else [])
    run_dir = Path(compose("train", overrides).run_dir)
    if (run_dir / "done.json").exists():
        print(f"=== {name or regime}: complete ({run_dir}), skipped")
        return run_dir
    resume = ["ckpt_path=last"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
    run_stage(name or regime, ["train.py", *overrides, *resume])
    return run_dir


def teacher_stage(common: list[str], steps: int) -> Path:
    """The base run trained on to `steps` steps, in <corpus>/teacher (resumed from the base's last.ckpt the first
    time, from its own after an interruption). Returns its run folder."""
    base_dir = Path(compose("train", ["+regime=base", *common]).run_dir)
    run_dir = base_dir.parent / "teacher"
    overrides = ["+regime=base", *common, f"steps.base={steps}", f"run_dir={run_dir}"]
    if (run_dir / "done.json").exists():
        print(f"=== teacher: complete ({run_dir}), skipped")
        return run_dir
    own = run_dir / "checkpoints" / "last.ckpt"
    start = own if own.exists() else base_dir / "checkpoints" / "last.ckpt"
    if not start.exists():
        sys.exit(f"stage 'teacher' needs the base run's checkpoint {start}; rerun the pipeline to train the base first")
    run_stage("teacher", ["train.py", *overrides, f"ckpt_path={start}"])
    return run_dir


def distilled_dir(common: list[str], teacher: Path | None) -> Path:
    """The folder distill.py writes for these overrides (and teacher): what distill/both train on and the report's
    teacher, named explicitly so that other corpora under distill/ (an earlier teacher's) never get in the way."""
    from bpd_train.distillation.job import prepare

    overrides = [*common, *([f"teacher={teacher}"] if teacher else [])]
    try:
        return prepare(compose("distill", overrides), overrides).out_dir
    except DistillError as e:
        sys.exit(f"stage 'distill': {e}")


def self_corpus_stage(common: list[str], extra: list[str], run: bool = True) -> list[str]:
    """Regime `self`: its init_from model's (the base, or regime.init_from in its pipeline.regime_overrides) own
    greedy output (distill.py teacher=<init_from> beam 1), made unless complete (run=False: only named). Returns the
    override that names it for the train stage."""
    init_from = Path(str(compose("train", ["+regime=self", *common, *extra]).regime.init_from))
    made = distilled_dir([*common, "distill.beam_size=1"], init_from)
    complete = read_manifest(made).get("complete") if (made / "manifest.json").exists() else False
    if run and complete:
        print(f"=== self-distill: complete ({made}), skipped")
    elif run:
        run_stage("self-distill", ["distill.py", *common, f"teacher={init_from}", "distill.beam_size=1"])
    return [f"regime.distilled_dir={made}"]


def best_run(report: dict) -> dict:
    """The run the demo exports: report["best"], chosen by evaluation.report.BEST_RULE (the fastest exact run that
    keeps BLEU within evaluate.max_bleu_drop of the base, else the base itself)."""
    from bpd_train.evaluation.report import choose_best

    return report.get("best") or choose_best(report)  # reports written before the rule existed


@dataclass
class Stage:
    """One step of the experiment: `kind` says which entry point (and, on SLURM, which sbatch file and resources)
    runs it; it starts once every stage in `after` is complete."""

    name: str
    kind: str  # train | distill | evaluate | export
    after: list[str]


@dataclass
class Plan:
    common: list[str]  # overrides for every stage
    k: int
    regimes: list[str]
    own: Any  # the `pipeline:` config section
    stages: list[Stage]

    @property
    def self_from(self) -> str | None:
        return self.own.get("self_from")


def stages(regimes: list[str], teacher_steps, self_from: str | None) -> list[Stage]:
    """THE stage list, in an order that runs (make demo runs it top to bottom; slurm/pipeline.sh submits it with
    these dependencies)."""
    out = [Stage("base", "train", [])]
    if teacher_steps:
        out.append(Stage("teacher", "train", ["base"]))
    if {"distill", "both"} & set(regimes):
        out.append(Stage("distill-corpus", "distill", ["teacher" if teacher_steps else "base"]))
    for regime in regimes:
        after = ["base"] + (["distill-corpus"] if regime in ("distill", "both") else [])
        if regime == "self":  # its init_from model's own greedy output first
            out.append(Stage("self-distill", "distill", [self_from or "base"]))
            after = [self_from or "base", "self-distill"]
        out.append(Stage(regime, "train", after))
    out.append(Stage("evaluate", "evaluate", ["base", *regimes]))
    out.append(Stage("export", "export", ["evaluate"]))
    return out


def make_plan(argv: list[str] | None = None) -> tuple[Plan, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--experiment",
        default="demo",
        help="experiment preset (conf/experiment/, '-' read as '_'): demo (~25 min on 2 cores), smoke "
        "(~3 min); demo-lm / smoke-lm: the same chain for a decoder-only (Llama-architecture) model "
        "trained from scratch on the corpus as prompt-format translation, distilled from itself; "
        "none: the full-size configs",
    )
    ap.add_argument("--k", type=int, default=4, help="block size of the heads runs")
    ap.add_argument(
        "--regimes",
        default=None,
        help=f"comma-separated head regimes, of {','.join(HEAD_REGIMES)} (default: the experiment's "
        f"pipeline.regimes, else {','.join(PAPER_REGIMES)})",
    )
    ap.add_argument(
        "--print-stages",
        action="store_true",
        help="print the stages (name, kind, the stages each waits for) one per line and stop; "
        "slurm/pipeline.sh submits these",
    )
    ap.add_argument("--stage", default=None, help="run this one stage (skipped when complete); SLURM stage jobs")
    ap.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="slurm: run the stage's command through its slurm/*.sbatch file inside the current job",
    )
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every stage, e.g. paths.artifacts=/tmp/a")
    args = ap.parse_args(argv)
    experiment = [] if args.experiment in ("", "none") else [f"experiment={args.experiment.replace('-', '_')}"]
    own = compose("train", ["+regime=base", *experiment, *args.overrides]).pipeline
    if args.regimes is None:
        args.regimes = list(own.get("regimes") or PAPER_REGIMES)
    else:
        args.regimes = [r for r in args.regimes.split(",") if r]
    if unknown := set(args.regimes) - set(HEAD_REGIMES):
        ap.error(f"unknown regime(s) {sorted(unknown)}; choose from {','.join(HEAD_REGIMES)}")
    self_from = own.get("self_from")
    if (
        "self" in args.regimes
        and self_from
        and (
            self_from not in args.regimes
            or self_from == "self"
            or args.regimes.index(self_from) > args.regimes.index("self")
        )
    ):
        ap.error(
            f"pipeline.self_from={self_from}: `self` starts from that regime's run, so it must be one of the "
            f"regimes trained before `self` (--regimes {','.join(args.regimes)})"
        )
    common = [*experiment, *(o for o in args.overrides if not o.lstrip("+~").startswith("pipeline."))]
    plan = Plan(common, args.k, args.regimes, own, stages(args.regimes, own.teacher_steps, self_from))
    if args.stage is not None and args.stage not in {s.name for s in plan.stages}:
        ap.error(f"--stage {args.stage}: not a stage of this plan ({', '.join(s.name for s in plan.stages)})")
    return plan, args


def _corpus_dir(plan: Plan) -> Path:
    return Path(compose("train", ["+regime=base", *plan.common]).run_dir).parent


def _teacher(plan: Plan) -> Path | None:
    return _corpus_dir(plan) / "teacher" if plan.own.teacher_steps else None


def _corpus_overrides(plan: Plan, regime: str) -> list[str]:
    if regime not in ("distill", "both"):
        return []
    return [f"regime.distilled_dir={distilled_dir(plan.common, _teacher(plan))}"]


def _self_extra(plan: Plan) -> list[str]:
    extra = list((plan.own.get("regime_overrides") or {}).get("self") or [])
    if plan.self_from:
        extra.append(f"regime.init_from={_corpus_dir(plan) / 'heads' / f'{plan.self_from}-k{plan.k}'}")
    return extra


def _eval_paths(plan: Plan) -> tuple[list[Path], Path]:
    eval_cfg = compose("evaluate", plan.common)
    corpus = Path(eval_cfg.paths.artifacts) / str(eval_cfg.data.name)
    runs = [corpus / "base", *(corpus / "heads" / f"{r}-k{plan.k}" for r in plan.regimes)]
    return runs, corpus / "eval" / f"demo-k{plan.k}"


def run_one(plan: Plan, stage: Stage) -> None:
    """Run one stage unless its artifact is complete (then say so)."""
    common, k = plan.common, plan.k
    if stage.name == "base":
        train_stage("base", common, k)  # also trains (or reuses) the corpus's sentencepiece model
    elif stage.name == "teacher":
        teacher_stage(common, int(plan.own.teacher_steps))
    elif stage.name == "distill-corpus":
        teacher = _teacher(plan)
        made = distilled_dir(common, teacher)
        if read_manifest(made).get("complete") if (made / "manifest.json").exists() else False:
            print(f"=== distill-corpus: complete ({made}), skipped")
        else:  # distill.py itself skips finished shards (a rerun after an interruption resumes)
            run_stage("distill-corpus", ["distill.py", *common, *([f"teacher={teacher}"] if teacher else [])])
    elif stage.name == "self-distill":
        self_corpus_stage(common, _self_extra(plan))
    elif stage.kind == "train":  # a heads regime
        regime = stage.name
        if regime == "self":
            extra = _self_extra(plan)
            extra += self_corpus_stage(common, extra, run=False)
        else:
            extra = list((plan.own.get("regime_overrides") or {}).get(regime) or [])
        train_stage(regime, common + extra + _corpus_overrides(plan, regime), k)
    elif stage.name == "evaluate":
        runs, eval_dir = _eval_paths(plan)
        report_path = eval_dir / "report.json"
        newest_run = max((r / "done.json").stat().st_mtime for r in runs)
        if report_path.exists() and report_path.stat().st_mtime > newest_run:
            print(f"=== evaluate: report is newer than every run ({report_path}), skipped")
            return
        inputs = "[" + ",".join(str(r) for r in runs) + "]"
        teacher_corpus = (
            [f"evaluate.distilled={distilled_dir(common, _teacher(plan))}"]
            if {"distill", "both"} & set(plan.regimes)
            else []
        )
        run_stage(
            "evaluate",
            ["evaluate.py", *common, f"evaluate.inputs={inputs}", f"evaluate.output_dir={eval_dir}", *teacher_corpus],
        )
    elif stage.name == "export":
        _, eval_dir = _eval_paths(plan)
        report_path = eval_dir / "report.json"
        report = json.loads(report_path.read_text(encoding="utf-8"))
        best = best_run(report)
        print(f"=== best run: {best['checkpoint']} — {best['reason']}\n    rule: {best['rule']}")
        if best.get("bleu_vs_base"):
            print("    BLEU against the base: " + ", ".join(f"{n} {d:+.2f}" for n, d in best["bleu_vs_base"].items()))
        if best["path"] is None:
            print("=== export: no run chosen; nothing to export")
            return
        bundle = eval_dir.parent.parent / "export" / "best"
        card = bundle / "README.md"
        path = best["path"]
        if card.exists() and card.stat().st_mtime > report_path.stat().st_mtime and path in card.read_text("utf-8"):
            print(f"=== export: bundle is newer than the report ({bundle}), skipped")
        else:
            run_stage(
                "export",
                [
                    "export.py",
                    *common,
                    f"export.checkpoint={path}",
                    f"export.output_dir={bundle}",
                    f"export.report={report_path}",
                    "export.overwrite=true",
                ],
            )
        print(f"best bundle: {bundle} ({path})")


def main(argv: list[str] | None = None) -> None:
    global LAUNCHER
    plan, args = make_plan(argv)
    if args.print_stages:
        for s in plan.stages:
            print(s.name, s.kind, ",".join(s.after) or "-")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    LAUNCHER = args.launcher
    if args.stage is not None:
        run_one(plan, next(s for s in plan.stages if s.name == args.stage))
        return
    t0 = time.monotonic()
    for stage in plan.stages:
        run_one(plan, stage)
    _, eval_dir = _eval_paths(plan)
    print(f"\nreport: {eval_dir / 'report.md'}\nplots:  {sorted(str(p) for p in eval_dir.glob('*.png'))}")
    print((eval_dir / "report.md").read_text(encoding="utf-8"))
    print(f"pipeline finished in {(time.monotonic() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
