"""Every option of every training config group composes and instantiates; entry-point argument checks."""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import bpd_train
from bpd_train.model import BPDModel
from bpd_train.training.regimes import Regime, available_regimes

CONF = bpd_train.REPO_ROOT / "conf"
GROUPS = ["model", "trainer", "strategy", "logger", "paths", "hydra", "experiment", "regime"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def cfg_for(*overrides: str, hydra_cfg: bool = False):
    with initialize_config_dir(str(CONF), version_base="1.3", job_name="train"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_cfg)


def test_groups_have_the_promised_options():
    assert set(options("model")) >= {"tiny", "base", "big"}
    assert set(options("trainer")) >= {"cpu", "gpu", "multinode"}
    assert set(options("strategy")) >= {"auto", "ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"}
    assert set(options("logger")) >= {"wandb", "csv", "none"}
    assert set(options("experiment")) >= {"smoke", "demo"}
    assert available_regimes() == ["base", "both", "distill", "finetune", "frozen", "self"]
    for group in GROUPS:  # every config file starts with a comment (the command that uses it)
        for p in (CONF / group).glob("*.yaml"):
            assert p.read_text().startswith("#"), p
    assert (CONF / "train.yaml").read_text().startswith("# python train.py")


@pytest.mark.parametrize("regime", available_regimes())
@pytest.mark.parametrize("experiment", [None, *options("experiment")])
def test_regime_and_experiment_compose_and_resolve(regime, experiment, tmp_path):
    ov = [f"+regime={regime}", f"paths.artifacts={tmp_path}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = cfg_for(*ov)
    c = OmegaConf.to_container(cfg, resolve=True)
    r = Regime.from_cfg(c["regime"])
    assert r.name == regime
    k = 1 if regime == "base" else c["model"]["block_size"]
    assert r.block_size == k and c["trainer"]["max_steps"] == c["steps"][r.stage]
    assert c["model"]["block_size"] == k  # k has one source: the base model's is 1, regime.block_size reads it
    sub = "base" if regime == "base" else f"heads/{regime}-k{k}"
    assert c["run_dir"] == f"{tmp_path}/{c['data']['name']}/{sub}"
    if regime != "base":
        assert r.init_from == f"{tmp_path}/{c['data']['name']}/base"
    assert r.freeze_backbone == (regime in ("frozen", "distill", "self"))
    assert r.source == {"distill": "distilled", "both": "distilled", "self": "self"}.get(regime, "gold")


def test_smoke_experiment_paths_and_sizes():
    c = OmegaConf.to_container(cfg_for("+regime=base", "experiment=smoke"), resolve=True)
    assert c["paths"]["artifacts"] == str(bpd_train.REPO_ROOT / "artifacts" / "smoke")
    assert c["trainer"]["accelerator"] == "cpu" and c["model"]["d_model"] <= 64
    assert c["trainer"]["max_steps"] <= 100 and c["trainer"]["limit_val_batches"] <= 8


@pytest.mark.parametrize("name", options("model"))
def test_model_options_build(name):
    from bpd_train.model import LMConfig, build_model, config_from_dict

    m = OmegaConf.to_container(cfg_for("+regime=base", f"model={name}").model, resolve=True)
    cfg = config_from_dict({"vocab_size": 1000, **m})  # arch: lm -> the decoder-only family
    assert isinstance(cfg, LMConfig) == (m.get("arch") == "lm")
    if name == "tiny":
        out = BPDModel(cfg)(torch.tensor([[5, 6, 2]]), torch.tensor([[1, 7]]))
        assert out.shape == (1, 2, cfg.block_size, 1000)
    if name == "lm_tiny":
        out = build_model(cfg)(torch.tensor([[5, 6, 2]]))
        assert out.shape == (1, 3, cfg.block_size, 1000)


@pytest.mark.parametrize("name", options("trainer"))
def test_trainer_options_instantiate(name, tmp_path, monkeypatch):
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_NNODES", "3")
    tc = cfg_for("+regime=frozen", f"trainer={name}").trainer
    c = OmegaConf.to_container(tc, resolve=True)
    params = inspect.signature(pl.Trainer.__init__).parameters
    assert set(c) - {"_target_"} <= set(params), set(c) - set(params)
    assert c["use_distributed_sampler"] is False
    if name == "multinode":
        assert (c["devices"], c["num_nodes"]) == (2, 3)
    if c["accelerator"] != "cpu" and not torch.cuda.is_available():
        tc = OmegaConf.merge(tc, {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "precision": "32-true"})
    t = instantiate(tc, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    assert isinstance(t, pl.Trainer) and t.max_steps == c["max_steps"]


@pytest.mark.parametrize("name", options("strategy"))
def test_strategy_options_instantiate(name, monkeypatch):
    from bpd_train.training.trainer import make_strategy

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    s = make_strategy(cfg_for("+regime=base", f"strategy={name}").strategy)
    if name == "auto":
        assert s == "auto"
    else:
        from lightning.pytorch.strategies import Strategy

        assert isinstance(s, Strategy)
        if name.startswith("deepspeed"):
            assert s.config["zero_optimization"]["stage"] == int(name[-1])
        if name == "deepspeed_zero3":  # the persistence threshold reaches DeepSpeed's config, and can be overridden
            assert s.config["zero_optimization"]["stage3_param_persistence_threshold"] == 100000
            s0 = make_strategy(
                cfg_for("+regime=base", f"strategy={name}", "strategy.param_persistence_threshold=0").strategy
            )
            assert s0.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0


@pytest.mark.parametrize("name", options("logger"))
def test_logger_options_instantiate(name, tmp_path, monkeypatch):
    from bpd_train.training.trainer import make_logger

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = cfg_for("+regime=base", f"logger={name}", f"paths.artifacts={tmp_path}")
    lg = make_logger(cfg, Path(cfg.run_dir), resuming=False)
    if name == "none":
        assert lg is False
    else:
        assert type(lg).__name__.lower().startswith(name)
    if name == "wandb":
        run_id = (Path(cfg.run_dir) / "wandb_id").read_text().strip()
        assert lg._wandb_init["id"] == run_id and lg._offline
        # a resumed run continues the same W&B run
        assert make_logger(cfg, Path(cfg.run_dir), resuming=True)._wandb_init["id"] == run_id


def test_wandb_offline_unless_configured(monkeypatch, tmp_path):
    from bpd_train.training.trainer import _wandb_offline

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert _wandb_offline(None) is True
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_offline(None) is False
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _wandb_offline(None) is True
    assert _wandb_offline(False) is False


def test_hydra_run_dir_keyed_by_slurm_job(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = cfg_for("+regime=base", hydra_cfg=True)
    assert cfg.hydra.run.dir.endswith("/train/4242") and cfg.hydra.job.chdir is False
    # every SLURM task runs Hydra: one log file per rank in the shared folder
    assert "SLURM_PROCID" in OmegaConf.to_container(cfg.hydra.job_logging)["handlers"]["file"]["filename"]
    monkeypatch.delenv("SLURM_JOB_ID")
    assert not cfg_for("+regime=base", hydra_cfg=True).hydra.run.dir.endswith("4242")


def test_slurm_environment_requeues_on_sigusr1(monkeypatch, tmp_path):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from bpd_train.training.trainer import make_trainer

    for k, v in {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NAME": "bpd",
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }.items():
        monkeypatch.setenv(k, v)
    cfg = cfg_for("+regime=base", "experiment=smoke", "logger=none", f"paths.artifacts={tmp_path}")
    t = make_trainer(cfg, Path(cfg.run_dir))
    env = t._accelerator_connector.cluster_environment  # what the signal connector reads
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal == signal.SIGUSR1
    assert t.default_root_dir == str(Path(cfg.run_dir) / "hpc" / "77")  # a new job never resumes an old one


def test_checkpoint_callback_layout(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from bpd_train.training.trainer import make_callbacks

    cfg = cfg_for("+regime=frozen", "experiment=smoke", f"paths.artifacts={tmp_path}")
    cbs = make_callbacks(cfg, Path(cfg.run_dir), has_logger=True)
    best, last = [c for c in cbs if isinstance(c, ModelCheckpoint)]
    assert best.dirpath == last.dirpath == str(Path(cfg.run_dir) / "checkpoints")
    assert best.filename == "best" and best.monitor == "val/loss" and best.save_top_k == 1
    # last.ckpt: its own callback without a metric, so it is written at every validation (not only with a new best)
    assert last.filename == "last" and last.monitor is None and last.save_top_k == 1 and not last.save_last
    names = {type(c).__name__ for c in cbs}
    assert {"Throughput", "BlockwiseEval"} <= names


def test_base_and_finetune_keep_their_best_greedy_bleu_checkpoint(tmp_path):
    """best.ckpt of the base (and of `finetune`) is the highest val/bleu: greedy BLEU on a fixed validation subset,
    the BLEU callback on even without heads; where that callback does not run at every validation, the lowest
    val/loss (a monitored metric missing after a validation would stop the run)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from bpd_train.training.trainer import make_callbacks

    def best_and_eval(*overrides):
        cfg = cfg_for(*overrides, "experiment=smoke", f"paths.artifacts={tmp_path}")
        cbs = make_callbacks(cfg, Path(cfg.run_dir), has_logger=False)
        best = next(c for c in cbs if isinstance(c, ModelCheckpoint) and c.filename == "best")
        ev = [c for c in cbs if type(c).__name__ == "BlockwiseEval"]
        return best, ev

    for regime in ("+regime=base", "+regime=finetune"):
        best, ev = best_and_eval(regime)
        assert (best.monitor, best.mode) == ("val/bleu", "max")
        assert len(ev) == 1 and ev[0].enabled is True and ev[0].n_sentences == 32  # smoke's subset
    for off in ("callbacks.blockwise_eval.enabled=false", "+callbacks.blockwise_eval.every_n_validations=2"):
        best, _ = best_and_eval("+regime=base", off)
        assert (best.monitor, best.mode) == ("val/loss", "min")
    best, ev = best_and_eval("+regime=base", "checkpoint.monitor=val/loss", "checkpoint.mode=min")
    assert best.monitor == "val/loss" and ev[0].enabled == "auto"  # off for the base model again
    best, _ = best_and_eval("+regime=frozen")
    assert best.monitor == "val/loss"


def _train_py(*args: str) -> subprocess.CompletedProcess:
    from conftest import offline_env

    return subprocess.run(
        [sys.executable, str(bpd_train.REPO_ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        env=offline_env(),
        timeout=120,
        cwd=bpd_train.REPO_ROOT,
    )


def test_train_without_regime_lists_choices():
    r = _train_py("experiment=smoke")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "+regime={base,both,distill,finetune,frozen,self}" in lines[0], r.stderr
    r = _train_py("regime=frozen")
    assert r.returncode != 0 and "+regime=" in r.stderr and len(r.stderr.strip().splitlines()) == 1
