# bash bench/gpu.sh        (on the GPU machine; this file is its python part: docs/GPU.md)
# python bench/gpu.py --device cpu --quick          (the same checks, tiny, on a CPU: what tests/test_bench_gpu.py runs)
"""What a CPU cannot check, in one run on one GPU; the last line printed is one JSON object.

Sections (each guarded: an error is reported in the JSON, the others still run):
  exactness   blockwise(Exact) == greedy over randomised models, batches and block sizes, fp32 (TF32 off)
  step_cost   one blockwise step (decode on k tokens + head 1 at the k positions + heads 2..k at one position)
              vs one greedy step (decode 1 token + head 1), demo size and Transformer-base size, k = 2/4/8,
              batch 1 and 32: bench/protocol.py's measure() (a warm-up pass, then 3 passes of 16 calls per step,
              the steps taking turns call by call), the median pass; eager and (optional) replayed as CUDA graphs
  lm_step_cost (optional) the same for decoder-only shapes of SmolLM2-135M and -1.7B with Medusa heads, bf16 on
              CUDA, k = 4/8, batch 1 and 8
  compile     (optional) the same steps under torch.compile(mode="reduce-overhead"), base size, batch 1
  speedup     blockwise vs greedy wall clock on random-weight models and, if present, the demo's trained runs:
              measure() with the batches as units, the median over batches of the rate ratio
  train       bf16-mixed smoke base -> frozen chain with strategy=deepspeed_zero2, deepspeed_zero3 (every
              parameter partitioned: persistence threshold 0) and fsdp (per-layer units); the frozen backbone must
              come out bit-identical, the in-training blockwise evaluation agree 100% with greedy (CUDA only)
With --out-dir (default $OUT) it also writes gpu.json and gpu.md (a markdown summary) there.
Without CUDA (and without --device cpu) it prints one JSON line saying it skipped, and exits 0.
Only the public model/decoding API is used: the decoder internals change under it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_decode import (  # noqa: E402
    LM_SIZES,
    QUICK_LM_SIZES,
    QUICK_SIZES,
    SIZES,
    check_exactness,
    compiled_step_cost,
    demo_speedups,
    log,
    random_speedups,
    step_cost_table,
)

# seconds kept back from the training chains for the optional torch.compile section that runs after them
COMPILE_RESERVE_S = 75


# ---------------------------------------------------------------------------------------------- training
def _metrics(run: Path) -> list[dict]:
    return [r for m in run.rglob("metrics.csv") for r in csv.DictReader(m.open())]


GPU_TRAINER = ("trainer=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed")


# strategy -> (config group option, extra overrides) of the training chains
TRAIN_CHAINS = {
    "deepspeed_zero2": ("deepspeed_zero2", ()),
    # threshold 0: the smoke model's parameters are all below DeepSpeed's default (1e5) and would never be
    # partitioned; real sizes are, so partition everything here
    "deepspeed_zero3": ("deepspeed_zero3", ("strategy.param_persistence_threshold=0",)),
    "fsdp": ("fsdp", ()),
}


def train_chain(
    strategy: str,
    art: Path,
    timeout: float,
    spm_from: Path | None,
    logdir: Path | None,
    trainer=GPU_TRAINER,
    overrides=(),
) -> dict:
    """python train.py +regime=base, then +regime=frozen, experiment=smoke, by default on one GPU in bf16-mixed."""
    from bpd_train.sources.loading import load  # the one resolver: also reads DeepSpeed ZeRO folders

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "bpd-torch-ext"))
    group, extra_over = TRAIN_CHAINS.get(strategy, (strategy, ()))
    common = [
        "experiment=smoke",
        *trainer,
        f"strategy={group}",
        *extra_over,
        *overrides,
        "logger=csv",
        "progress_bar=none",
        f"paths.artifacts={art}",
    ]
    res: dict = {"strategy": strategy}
    if spm_from is not None:  # the tokenizer the first chain trained: no second sentencepiece run
        shutil.copytree(spm_from, art / spm_from.parent.name / "spm")
    deadline = time.monotonic() + timeout
    for regime, extra in (("base", []), ("frozen", ["trainer.val_check_interval=10"])):
        left = deadline - time.monotonic()
        if left < 20:
            res[regime] = {"ok": False, "error": "no time left"}
            return res
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            f"+regime={regime}",
            *common,
            *extra,
            f"hydra.run.dir={art}-hydra/{regime}",
        ]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
        if logdir is not None:
            (logdir / f"train-{strategy}-{regime}.log").write_text(text[-200_000:])
        res[regime] = {
            "rc": rc,
            "s": round(time.monotonic() - t0, 1),
            "log_mentions_bf16": "bf16" in text.lower(),
        }  # Lightning names the precision it set up
        if rc != 0:
            res[regime].update(ok=False, tail=text[-1500:])
            return res
        res[regime]["ok"] = True
    corpus = next(art.glob("*/base")).parent
    base = load(corpus / "base")
    frozen_run = next((corpus / "heads").glob("frozen-k*"))
    frozen = load(frozen_run)
    fsd, bsd = frozen.model.state_dict(), base.model.state_dict()
    rows = _metrics(frozen_run)
    agree = [float(r["val/agreement"]) for r in rows if r.get("val/agreement")]
    losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    res.update(
        # a frozen backbone must come through the strategy bit-identical (bf16 engines may round it)
        backbone_identical=all(torch.equal(fsd[k].float(), v.float()) for k, v in bsd.items()),
        heads_trained=any(bool(fsd[k].abs().sum() > 0) for k in fsd if k.startswith("heads.fc2")),
        val_agreement=agree,
        val_loss_finite=bool(losses) and all(math.isfinite(x) for x in losses),
        checkpoint=str(next((frozen_run / "checkpoints").glob("last*")).name),
    )
    # identity_p1 promises the base model's greedy output bit for bit: a rounded backbone breaks that promise
    res["ok"] = bool(
        res["heads_trained"] and res["val_loss_finite"] and res["backbone_identical"] and agree and min(agree) == 100.0
    )
    res["spm"] = str(corpus / "spm")
    return res


# ---------------------------------------------------------------------------------------------- main
def write_json(path: Path | None, obj: dict) -> None:
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the decoding checks on the CPU (logic only; numbers meaningless)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few cases")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=430.0,
        help="stop starting sections after this many seconds (bench/gpu.sh kills at 450 s)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to leave out: exactness,step_cost,lm_step_cost,compile,speedup,demo,train",
    )
    ap.add_argument(
        "--demo-dir",
        type=Path,
        default=ROOT / "artifacts" / "demo",
        help="where `make demo` put its runs (carried to the device if you want demo speedups)",
    )
    ap.add_argument(
        "--train-chains",
        default=",".join(TRAIN_CHAINS),
        help=f"comma-separated training chains of the train section (default: all of {','.join(TRAIN_CHAINS)})",
    )
    ap.add_argument("--partial", type=Path, default=None, help="rewrite this file with the results so far")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="also write gpu.json and the training logs here (default: $OUT when set)",
    )
    args = ap.parse_args(argv)
    args.train_chains = [c for c in args.train_chains.split(",") if c]
    if not args.train_chains or set(args.train_chains) - set(TRAIN_CHAINS):
        ap.error(f"--train-chains: choose from {','.join(TRAIN_CHAINS)}")
    known = {"exactness", "step_cost", "lm_step_cost", "compile", "speedup", "demo", "train"}
    bad = set(filter(None, args.skip.split(","))) - known
    if bad:
        ap.error(f"--skip: unknown section(s) {sorted(bad)}; choose from {sorted(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    result: dict = {"bench": "gpu", "device": args.device, "quick": args.quick, "torch": torch.__version__}
    if args.device == "cuda" and not torch.cuda.is_available():
        result.update(skipped="no CUDA device visible (torch.cuda.is_available() is False)", ok=None)
        print(json.dumps(result))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        # the exactness claim and the step-cost table are for fp32; TF32 matmuls would be a lower precision
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        result.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, tf32=False)
    else:
        torch.set_num_threads(1)
    result["packages"] = package_versions()
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    sections: dict = {}
    errors: dict = {}
    result.update(sections=sections, errors=errors)
    sizes = QUICK_SIZES if args.quick else SIZES
    cuda = device.type == "cuda"

    def run(name: str, fn, required: bool = True, min_left: float = 15) -> None:
        if name in skip:
            sections[name] = {"skipped": "--skip"}
            return
        left = args.budget_s - (time.monotonic() - t_start)
        if left < min_left:
            sections[name] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
            if required:
                errors[name] = "not run: time budget spent"
            return
        log(f"{name} ({left:.0f} s of the budget left)")
        t0 = time.monotonic()
        try:
            sections[name] = fn()
            sections[name]["s"] = round(time.monotonic() - t0, 1)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            sections[name] = {"error": errors[name], "traceback": traceback.format_exc()[-1500:]}
            if not required:  # optional sections report their failure without failing the run
                del errors[name]
            log(f"{name} failed: {errors.get(name, sections[name]['error'])}")
        write_json(args.partial, result)

    run("exactness", lambda: check_exactness(device, args.quick))
    calls = 4 if args.quick else 16  # step calls per pass: one warm-up pass and 3 timed ones (bench/protocol.py)
    run(
        "step_cost",
        lambda: step_cost_table(device, sizes, calls=calls, graphs=cuda, batches=(1, 4) if args.quick else (1, 32)),
    )
    run(  # decoder-only shapes of real LLMs in the precision they are served in: the step-cost rule on a GPU
        "lm_step_cost",
        lambda: step_cost_table(
            device,
            QUICK_LM_SIZES if args.quick else LM_SIZES,
            ks=(4, 8),
            batches=(1, 8),
            calls=calls,
            graphs=cuda,
            dtype=torch.bfloat16 if cuda else torch.float32,
        ),
        required=False,
    )
    run(
        "speedup",
        lambda: random_speedups(
            device,
            sizes,
            batch_sizes=(1, 4) if args.quick else (1, 32),
            sentences=8 if args.quick else 32,
            max_len=8 if args.quick else 32,
        ),
    )
    run("demo", lambda: demo_speedups(device, args.demo_dir), required=False)
    if cuda:

        def train() -> dict:
            out: dict = {}
            with tempfile.TemporaryDirectory(prefix="bpd-gpu-train-") as tmp:
                spm = None
                chains = args.train_chains
                for i, strategy in enumerate(chains):
                    reserve = 0 if "compile" in skip else COMPILE_RESERVE_S
                    left = args.budget_s - reserve - (time.monotonic() - t_start)
                    share = left / (len(chains) - i)  # what is left, split between the chains still to run
                    # a shorter base run: the chains check that training works, not what it reaches
                    out[strategy] = train_chain(
                        strategy, Path(tmp) / strategy / "art", share, spm, args.out_dir, overrides=("steps.base=20",)
                    )
                    if out[strategy].get("spm"):
                        spm = Path(out[strategy].pop("spm"))
                    write_json(args.partial, result)
            out["ok"] = all(out[s].get("ok") for s in chains)
            return out

        run("train", train)
    else:
        sections["train"] = {
            "skipped": "CUDA only: Lightning's DeepSpeed and FSDP strategies refuse CPU "
            "(the CPU suite covers them through shims)"
        }
    if cuda:  # last: optional, and its compile time is the least predictable
        run(
            "compile",
            lambda: compiled_step_cost(device, SIZES["base"] if not args.quick else sizes["tiny"]),
            required=False,
            min_left=COMPILE_RESERVE_S - 15,
        )
    else:
        sections["compile"] = {"skipped": "CUDA only (reduce-overhead mode records CUDA graphs)"}
    required_ok = [sections[s].get("ok", True) for s in ("exactness", "train") if s in sections]
    result["ok"] = not errors and all(x is not False for x in required_ok)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    write_json(args.partial, result)
    if args.out_dir is not None:
        write_json(args.out_dir / "gpu.json", result)
        tmp = args.out_dir / "gpu.md.tmp"
        tmp.write_text(markdown_summary(result))
        os.replace(tmp, args.out_dir / "gpu.md")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def markdown_summary(result: dict) -> str:
    """gpu.md: one line per section and check, for a person reading the device call's files."""

    def mark(v):
        return {True: "ok", False: "FAILED", None: "-"}.get(v, str(v))

    lines = [
        f"# bench/gpu.py on {result.get('gpu', result.get('device'))}",
        "",
        f"overall: **{mark(result.get('ok'))}**, torch {result.get('torch')}, CUDA {result.get('cuda', '-')}, "
        f"{result.get('wall_s', '?')} s",
        "",
    ]
    if result.get("skipped"):
        return "\n".join(lines + [f"skipped: {result['skipped']}", ""])
    lines += ["| section | result | seconds | notes |", "|---|---|---|---|"]
    for name, sec in (result.get("sections") or {}).items():
        if "skipped" in sec:
            lines.append(f"| {name} | skipped | - | {sec['skipped']} |")
            continue
        if "error" in sec:
            lines.append(f"| {name} | FAILED | - | {str(sec['error'])[:200]} |")
            continue
        note = ""
        if name == "exactness":
            note = f"{sec.get('mismatched_rows')} mismatched rows in {sec.get('cases')} cases"
        elif name == "train":
            note = "; ".join(
                f"{s}: {mark(v.get('ok'))} (backbone identical {v.get('backbone_identical')}, "
                f"agreement {v.get('val_agreement')})"
                for s, v in sec.items()
                if isinstance(v, dict)
            )
        elif name in ("step_cost", "lm_step_cost"):
            table = sec.get("cuda_graphs") or sec.get("eager") or {}
            note = "; ".join(
                f"{key}: " + ", ".join(f"{c.split('_')[0]} {v}" for c, v in row.items() if c.endswith("_greedy_steps"))
                for key, row in table.items()
            )
            note = ("greedy steps per k-row step (CUDA graphs) " if sec.get("cuda_graphs") else "") + note
        elif name == "speedup":
            note = ", ".join(
                f"{k} x{v.get('speedup', 0):.2f}" for k, v in sec.items() if isinstance(v, dict) and "speedup" in v
            )
        lines.append(f"| {name} | {mark(sec.get('ok', True))} | {sec.get('s', '-')} | {note} |")
    for name, err in (result.get("errors") or {}).items():
        lines.append(f"\nerror in {name}: {err}")
    return "\n".join(lines) + "\n"


def package_versions() -> dict:
    """Versions of what the training section needs (carried or the image's) and whether each imports: the
    carried wheels go in with --no-deps, so a clash with the image's versions shows up here, not in pip."""
    import importlib
    from importlib import metadata

    out = {}
    for dist, module in (
        ("lightning", "lightning"),
        ("hydra-core", "hydra"),
        ("omegaconf", "omegaconf"),
        ("datasets", "datasets"),
        ("deepspeed", "deepspeed"),
        ("pydantic", "pydantic"),
        ("pyarrow", "pyarrow"),
        ("fsspec", "fsspec"),
        ("huggingface-hub", "huggingface_hub"),
        ("sentencepiece", "sentencepiece"),
    ):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):  # deepspeed logs to stdout on import; ours is the JSON
                importlib.import_module(module)
            out[dist] = version
        except Exception as e:  # installed but broken: say why
            out[dist] = f"{version} (import fails: {type(e).__name__}: {str(e)[:150]})"
    return out


if __name__ == "__main__":
    sys.exit(main())
