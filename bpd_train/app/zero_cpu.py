"""`python -m bpd_train.app.zero_cpu`: train.py's run under DeepSpeed ZeRO on the CPU (bpd_train/training/zero_cpu.py
`train_zero_cpu`), a real ZeRO checkpoint without a GPU (tests, export on CPU); the command line is checked as
train.py's is."""

from __future__ import annotations

import os

# Must be decided before DeepSpeed picks its accelerator (at its first get_accelerator() call).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402

from bpd_train.app.cli import check_argv, exits_on_user_error  # noqa: E402
from bpd_train.configs import REPO_ROOT  # noqa: E402
from bpd_train.training.zero_cpu import PRECISIONS, train_zero_cpu  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """python -m bpd_train.app.zero_cpu [--stage 2] [--devices 1] <train.py overrides...>"""
    from hydra import compose, initialize_config_dir

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument(
        "--stage",
        type=int,
        default=None,
        help="ZeRO stage (default: the stage of strategy=deepspeed_zero2|3 when given, else 2)",
    )
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="32-true",
        help="bf16-mixed: DeepSpeed's bf16 engine (parameters cast to bf16, fp32 masters)",
    )
    args, overrides = ap.parse_known_args(argv)
    check_argv(overrides)
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3", job_name="train"):
        cfg = compose("train", overrides=overrides)
    stage = args.stage
    if stage is None:  # strategy=deepspeed_zero3 on the command line means stage 3, not the default 2
        stage = int(cfg.strategy.get("stage", 2)) if "DeepSpeed" in str(cfg.strategy.get("_target_", "")) else 2
    print(exits_on_user_error(train_zero_cpu)(cfg, stage=stage, devices=args.devices, precision=args.precision))


if __name__ == "__main__":
    main()
