"""The Lightning Trainer a training run fits with, assembled from the config: logger (one W&B run per training
run, resumed with it), strategy (DDP / DeepSpeed ZeRO / FSDP, FSDP on CPU over gloo), callbacks (best.ckpt and
last.ckpt, progress bar, the config's own), SLURM requeue, TF32 on CUDA. Nothing here depends on the model
family; training/run.py composes data, model and this Trainer.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from bpd_train.io import atomic_write_text

log = logging.getLogger(__name__)


class TrainError(ValueError):
    """A problem the user fixes (missing base model, mismatched tokenizer, bad option): one line, no traceback."""


def plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg


def is_rank_zero() -> bool:
    return getattr(rank_zero_only, "rank", 0) == 0


def _wandb_offline(setting: Any) -> bool:
    """W&B runs online only when the user configured it: WANDB_MODE wins, then an API key or a login."""
    if setting is not None:
        return bool(setting)
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode:
        return mode != "online" and mode != "run"
    if os.environ.get("WANDB_API_KEY"):
        return False
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" not in netrc.read_text()
    except OSError:
        return True


def make_logger(cfg: DictConfig, run_dir: Path, resuming: bool):
    lc = cfg.get("logger")
    if lc is None or "_target_" not in lc:
        return False
    from hydra.utils import instantiate

    kw: dict[str, Any] = {}
    if lc._target_.endswith("WandbLogger"):
        kw["offline"] = _wandb_offline(lc.get("offline"))
        # One W&B run per training run: the id lives in the run folder and a resume continues it.
        id_file = run_dir / "wandb_id"
        if resuming and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            import secrets

            run_id = secrets.token_hex(6)
            if is_rank_zero():
                atomic_write_text(id_file, run_id + "\n")
        kw.update(id=run_id, resume="allow")
        Path(lc.save_dir).mkdir(parents=True, exist_ok=True)
    return instantiate(lc, **kw)


def make_strategy(sc: Any, accelerator: str = "auto"):
    if sc is None:
        return "auto"
    if "_target_" in sc:
        from hydra.utils import instantiate

        if sc["_target_"] == "lightning.pytorch.strategies.FSDPStrategy" and accelerator == "cpu":
            # Lightning allows FSDP on GPUs only; PyTorch's FSDP runs on CPU over gloo (trying configs, tests)
            return instantiate(sc, _target_="bpd_train.training.fsdp_cpu.CPUFSDPStrategy")
        if "param_persistence_threshold" in sc:
            # ZeRO-3's persistence threshold is no DeepSpeedStrategy argument: it goes into the DeepSpeed config
            # the strategy built (parameters with fewer elements stay whole on every rank; 0 partitions all)
            from omegaconf import OmegaConf

            kw = OmegaConf.to_container(sc, resolve=True) if OmegaConf.is_config(sc) else dict(sc)
            threshold = kw.pop("param_persistence_threshold")
            s = instantiate(kw)
            if threshold is not None:
                s.config.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = int(threshold)
            return s
        return instantiate(sc)
    return str(sc.get("name", "auto"))


def _best_checkpoint_class():
    from lightning.pytorch.callbacks import ModelCheckpoint

    class BestCheckpoint(ModelCheckpoint):
        """best.ckpt's callback. Without a metric (checkpoint.monitor=null: best = the latest) its state key would
        equal last.ckpt's and Lightning refuses two such callbacks, so it gets its own; with a metric the key is
        ModelCheckpoint's, as in checkpoints written before this class existed (resume keeps its best score)."""

        @property
        def state_key(self) -> str:
            key = super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)
            return key if self.monitor is not None else key + "[best]"

    return BestCheckpoint


BLEU_METRIC = "val/bleu"


def _bleu_monitor(cb_cfgs: dict, mode: str) -> tuple[str | None, str, dict]:
    """checkpoint.monitor=val/bleu: (monitor, mode, callback configs). The BLEU comes from the blockwise_eval
    callback (greedy, or exact blockwise = greedy, on a fixed validation subset), turned on here for a model
    without heads too; where it is off or skips validations, best.ckpt falls back to the lowest val/loss
    (Lightning stops a run whose monitored metric is missing after a validation)."""
    be = cb_cfgs.get("blockwise_eval")
    enabled = None if be is None else str(be.get("enabled", "auto")).lower()
    if be is None or enabled == "false" or int(be.get("every_n_validations", 1)) != 1:
        log.warning(
            "checkpoint.monitor=%s needs callbacks.blockwise_eval at every validation; best.ckpt: the lowest val/loss",
            BLEU_METRIC,
        )
        return "val/loss", "min", cb_cfgs
    on = OmegaConf.create(plain(be))
    on.enabled = True
    return BLEU_METRIC, mode, {**cb_cfgs, "blockwise_eval": on}


def make_callbacks(cfg: DictConfig, run_dir: Path, has_logger: bool) -> list[pl.Callback]:
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar, TQDMProgressBar

    ck = cfg.get("checkpoint", {})
    monitor, mode = ck.get("monitor", "val/loss"), ck.get("mode", "min")
    cb_cfgs = dict(cfg.get("callbacks") or {})
    if monitor == BLEU_METRIC:
        monitor, mode, cb_cfgs = _bleu_monitor(cb_cfgs, mode)
    # best.ckpt (by the monitored metric) and last.ckpt (the latest validation, always) are two callbacks:
    # Lightning 2.6's save_last writes last.ckpt only when a top-k checkpoint is saved at the same step, so once
    # the metric stopped improving, last.ckpt (what ckpt_path=last and the pipeline resume from) stayed behind.
    where = dict(
        dirpath=str(run_dir / "checkpoints"),
        save_top_k=1,
        save_last=False,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    cbs: list[pl.Callback] = [
        _best_checkpoint_class()(filename="best", monitor=monitor, mode=mode, **where),
        ModelCheckpoint(filename="last", monitor=None, **where),
    ]
    if has_logger:
        cbs.append(LearningRateMonitor(logging_interval="step"))
    bar = str(cfg.get("progress_bar", "tqdm"))
    if bar == "rich":
        cbs.append(RichProgressBar())
    elif bar == "tqdm":
        cbs.append(TQDMProgressBar(refresh_rate=max(1, int(os.environ.get("BPD_PROGRESS_REFRESH", 1)))))
    for c in cb_cfgs.values():
        if c is None or "_target_" not in c:
            continue
        cbs.append(instantiate(c))
    return cbs


def default_root_dir(run_dir: Path) -> Path:
    # Lightning puts SLURM requeue checkpoints (hpc_ckpt_N.ckpt) here and resumes from them automatically:
    # keyed by job id so that a new job never picks up an old job's state.
    job = os.environ.get("SLURM_JOB_ID")
    return run_dir / "hpc" / job if job else run_dir


def check_accelerator(cfg: DictConfig) -> None:
    acc = str(cfg.trainer.get("accelerator", "auto"))
    if acc in ("gpu", "cuda") and not torch.cuda.is_available():
        raise TrainError(
            f"trainer.accelerator={acc} but no CUDA device is visible; on a CPU use trainer=cpu "
            f"(experiment=smoke and experiment=demo do)"
        )


def enable_tf32(accelerator: str) -> bool:
    """Training on CUDA: fp32 matmuls on TF32 tensor cores (Ampere and later), as every bf16-mixed run's fp32 parts
    and 32-true runs want; PyTorch leaves them off by default. Decoding and evaluation entry points never call this,
    so their fp32 arithmetic stays IEEE. Returns whether it was turned on."""
    if accelerator == "cpu" or not torch.cuda.is_available():
        return False
    torch.set_float32_matmul_precision("high")  # = torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def make_trainer(cfg: DictConfig, run_dir: Path, resuming: bool = False, **overrides) -> pl.Trainer:
    from hydra.utils import instantiate
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    check_accelerator(cfg)
    logger = make_logger(cfg, run_dir, resuming)
    plugins = []
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1))
    bar = str(cfg.get("progress_bar", "tqdm"))
    kw = dict(
        callbacks=make_callbacks(cfg, run_dir, logger is not False),
        logger=logger,
        strategy=make_strategy(cfg.get("strategy"), str(cfg.trainer.get("accelerator", "auto"))),
        plugins=plugins or None,
        default_root_dir=str(default_root_dir(run_dir)),
        use_distributed_sampler=False,
        enable_progress_bar=bar != "none",
    )
    kw.update(overrides)
    trainer = instantiate(cfg.trainer, **kw)
    if logger is not False:
        logger.log_hyperparams(plain(cfg))
    return trainer
