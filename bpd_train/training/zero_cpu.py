"""DeepSpeed ZeRO on CPU, through Lightning: real ZeRO checkpoints without a GPU (tests, export on CPU).

    DS_ACCELERATOR=cpu python -m bpd_train.app.zero_cpu +regime=base experiment=smoke trainer.max_steps=2
    from bpd_train.training.zero_cpu import train_zero_cpu; ckpt_dir = train_zero_cpu(cfg, stage=2)

Lightning's DeepSpeedStrategy refuses anything but CUDA, yet the DeepSpeed engine itself runs on CPU
(`DS_ACCELERATOR=cpu`, gloo). `CPUDeepSpeedStrategy` removes exactly the three CUDA assumptions:
the accelerator check in setup_environment, the device-index check in setup_distributed, and the
`device_rank=root_device.index` (None on CPU) handed to deepspeed.initialize. Everything else -- ZeRO
partitioning, the optimizer wrapper, checkpoint save/load -- is Lightning's and DeepSpeed's own code, so the
checkpoint folder is the one a GPU run with `strategy=deepspeed_zero2` writes:

    <run_dir>/checkpoints/last.ckpt/            (a folder; best.ckpt/ likewise)
        latest                                  tag file ("checkpoint")
        zero_to_fp32.py
        checkpoint/mp_rank_00_model_states.pt   module states + Lightning client state (incl. ckpt["bpd"])
        checkpoint/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one ZeRO optimizer shard per rank

Consolidate with lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict (export.py
does). The first run JIT-compiles DeepSpeed's CPU shared-memory comm op (~30 s-3 min) into
$TORCH_EXTENSIONS_DIR (the Makefile points it at .torch_extensions/), later runs reuse it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# Must be decided before DeepSpeed picks its accelerator (at its first get_accelerator() call).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from lightning.pytorch.strategies.ddp import DDPStrategy  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with its CUDA-only checks removed; use with accelerator=cpu (32-true, or
    bf16-mixed: DeepSpeed's bf16 engine, the GPU runs' precision)."""

    strategy_name = "deepspeed_cpu"

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(*args, **kwargs)

    def setup_environment(self) -> None:
        # DeepSpeedStrategy.setup_environment = CUDA check + DDPStrategy.setup_environment
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        # DeepSpeedStrategy.setup_distributed minus _validate_device_index_selection (CPU devices have no index)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        params = filter(lambda p: p.requires_grad, model.parameters())
        engine, opt, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, opt


PRECISIONS = ("32-true", "bf16-mixed")


def zero_cpu_overrides(stage: int = 2, devices: int = 1, precision: str = "32-true") -> dict[str, Any]:
    """Config values that turn a composed training config into a CPU ZeRO run."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} on CPU, got {precision!r}")
    return {
        "strategy": {"_target_": f"{__name__}.CPUDeepSpeedStrategy", "stage": stage, "logging_batch_size_per_gpu": 1},
        "trainer": {"accelerator": "cpu", "devices": devices, "precision": precision},
    }


def train_zero_cpu(
    cfg: DictConfig, stage: int = 2, devices: int = 1, max_steps: int | None = None, precision: str = "32-true"
) -> Path:
    """Train `cfg` (any regime) with ZeRO-`stage` on CPU; returns the ZeRO checkpoint folder (last.ckpt/).

    devices > 1 launches the extra ranks by re-running this process's command line (Lightning's launcher),
    so call it from a script (e.g. `python -m bpd_train.training.zero_cpu ...`), never inside pytest.
    """
    from bpd_train.training.run import train

    cfg = cfg.copy()
    over = zero_cpu_overrides(stage, devices, precision)
    with open_dict(cfg):
        cfg.strategy = over["strategy"]  # replaced, not merged: any strategy group option may be selected
        for key, value in over["trainer"].items():
            cfg.trainer[key] = value
        if max_steps is not None:
            cfg.trainer.max_steps = int(max_steps)
    run_dir = train(cfg)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if not (ckpt / "latest").is_file():
        raise RuntimeError(f"expected a ZeRO checkpoint folder at {ckpt}")
    return ckpt


if __name__ == "__main__":  # the command line lives in the front ends now; say so instead of doing nothing
    print("error: the ZeRO CPU command is `python -m bpd_train.app.zero_cpu ...` (same arguments)", file=sys.stderr)
    raise SystemExit(2)
