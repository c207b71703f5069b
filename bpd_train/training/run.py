"""`python train.py +regime=X`: compose data, model, trainer and fit. One function per step so that tests,
the CPU ZeRO path and benchmarks reuse them.

Run folder (`cfg.run_dir`): ${paths.artifacts}/<corpus>/base or .../heads/<regime>-k<k>, holding
checkpoints/{best,last}.ckpt, tokenizer.model and the resolved config.yaml.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from bpd_train.data.distilled import DistillError, find_self_corpus
from bpd_train.data.hf_tokenizer import tokenizer_files
from bpd_train.families import family_of
from bpd_train.io import atomic_write_bytes, atomic_write_text
from bpd_train.model import BPDModel, config_from_dict
from bpd_train.sources.checkpoint import CheckpointError, checkpoint_meta, read_checkpoint
from bpd_train.training.losses import kd_settings
from bpd_train.training.module import BPDLightningModule
from bpd_train.training.regimes import Regime, available_regimes
from bpd_train.training.trainer import (
    TrainError,
    check_accelerator,
    default_root_dir,
    enable_tf32,
    is_rank_zero,
    make_trainer,
    plain,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ data
def _launch_ranks() -> tuple[int, int, str | None]:
    """(global rank, world size, launch id) before any process group exists. The launch id names one start of
    all ranks at once (srun, torchrun); None when Lightning's own launcher starts the other ranks, which it does
    from inside trainer.fit, after rank 0 prepared the data."""
    env = os.environ
    rank = int(getattr(rank_zero_only, "rank", 0) or 0)
    if env.get("TORCHELASTIC_RUN_ID"):
        return rank, int(env.get("WORLD_SIZE", 1)), "elastic-" + env["TORCHELASTIC_RUN_ID"]
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if SLURMEnvironment.detect() and env.get("SLURM_JOB_ID"):
        launch = "-".join(env.get(k, "0") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"))
        return int(env.get("SLURM_PROCID", rank)), int(env.get("SLURM_NTASKS", 1)), "slurm-" + launch
    return rank, int(env.get("WORLD_SIZE", 1)), None


def prepare_data_once(dm: Any, run_dir: Path, timeout: float | None = None) -> None:
    """dm.prepare_data() (train the tokenizer, tokenize into the datasets cache) on global rank 0 only; the other
    ranks of a launch that starts them all at once wait for it, instead of racing it on the same caches. The
    artifacts folder must be shared by all nodes (rank 0 also writes the checkpoints there)."""
    import time

    rank, world, launch = _launch_ranks()
    if world <= 1 or rank == 0:
        dm.prepare_data()
        if world > 1 and launch is not None:
            atomic_write_text(run_dir / f".data-ready-{launch}", f"{world}\n")
        return
    if launch is None:
        return
    marker = run_dir / f".data-ready-{launch}"
    limit = float(os.environ.get("BPD_PREPARE_TIMEOUT", 6 * 3600)) if timeout is None else timeout
    start = time.monotonic()
    while not marker.is_file():
        if time.monotonic() - start > limit:
            raise TrainError(
                f"rank {rank}: rank 0 did not finish preparing the data within {limit:.0f} s (no {marker}); "
                "see rank 0's log (BPD_PREPARE_TIMEOUT sets the wait)"
            )
        time.sleep(0.5)


def clear_data_marker(run_dir: Path) -> None:
    """Rank 0, once training ran (every rank passed the wait): remove this launch's marker."""
    rank, world, launch = _launch_ranks()
    if rank == 0 and world > 1 and launch is not None:
        (run_dir / f".data-ready-{launch}").unlink(missing_ok=True)


def make_datamodule(
    cfg: DictConfig, regime: Regime, tokenizer: Any = None, family: Any = None, max_positions: int | None = None
):
    """The run's datamodule, as the model's family makes it (family: the model's, default conf/model's).
    tokenizer: an imported model's own (LoadedModel.data_tokenizer()); None = the corpus's sentencepiece model.
    max_positions: the model's context (a decoder-only model's records are cut to it)."""
    family = family_of(cfg.model) if family is None else family
    return family.datamodule(cfg, regime, tokenizer=tokenizer, max_positions=max_positions)


def self_corpus(cfg: DictConfig, regime: Regime) -> Regime:
    """Regime source `self`: the regime, reading the corpus of its init_from model's own greedy output (made by
    `distill.py teacher=<init_from> distill.beam_size=1`; regime.distilled_dir, when set, must be one)."""
    from bpd_train.sources.loading import resolve

    try:
        sha = resolve(regime.init_from).id.removeprefix("sha256:")
        found = find_self_corpus(
            Path(str(cfg.paths.artifacts)) / str(cfg.data.name), sha, model=regime.init_from, given=regime.distilled_dir
        )
    except (CheckpointError, DistillError) as e:
        raise TrainError(str(e)) from None
    log.info("train source: %s's own greedy output, %s", regime.init_from, found)
    return dataclasses.replace(regime, source="distilled", distilled_dir=str(found))


# ----------------------------------------------------------------------------------------------- model
def _make_base_hint() -> str:
    """`python train.py +regime=base ...` with this run's corpus/experiment/paths overrides."""
    keep = []
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            for o in HydraConfig.get().overrides.task:
                key = o.split("=", 1)[0].lstrip("+~")
                if (
                    key == "regime"
                    or key.startswith(("regime.", "hydra.", "callbacks."))
                    or key
                    in ("ckpt_path", "model.block_size", "model.head_d_hidden", "model.identity_p1", "model.head_chain")
                ):
                    continue
                keep.append(o)
    except Exception:  # noqa: BLE001 - the hint is a courtesy
        pass
    return " ".join(["python train.py +regime=base", *keep])


def open_init(init_from: str) -> Any:
    """The model a head regime starts from (a .ckpt, a run folder, a bundle, a DeepSpeed ZeRO run or hf:...)."""
    from bpd_train.sources.loading import load, resolve

    try:
        source = resolve(init_from)
    except CheckpointError as e:
        raise TrainError(f"no base model at {init_from} ({e}); make it with: {_make_base_hint()}") from None
    return load(source, map_location="cpu")


def load_init(init_from: str, tokenizer, loaded: Any = None) -> Any:
    """The model a head regime starts from, checked against this run's tokenizer."""
    from bpd_train.sources.loading import check_tokenizer

    loaded = loaded if loaded is not None else open_init(init_from)
    # an imported model's embedding may be padded beyond its tokenizer (checked when it loaded); its hash decides
    if loaded.config.vocab_size != tokenizer.vocab_size and not loaded.own_tokenizer:
        raise TrainError(
            f"{loaded.source} has a vocabulary of {loaded.config.vocab_size} but this run's tokenizer "
            f"{tokenizer.path} has {tokenizer.vocab_size}: it was trained on another corpus or with "
            f"other sentencepiece settings (init_from={init_from})"
        )
    check_tokenizer(
        loaded.source,
        loaded.tokenizer_hash,
        "this run",
        tokenizer.path,
        tokenizer.hash,
        error=TrainError,
        hint="; same vocabulary size, different pieces: train the base model on this corpus/settings or "
        "point init_from at a matching one",
    )
    return loaded


def run_family(cfg: DictConfig, init: Any = None, resume: str | None = None) -> tuple[Any, int]:
    """(the family of the model this run trains, its max_positions): the checkpoint's config when resuming, the
    init_from model's (head regimes), else conf/model (base)."""
    if resume and resume != "hpc" and Path(resume).is_file():
        mc = checkpoint_meta(read_checkpoint(resume), resume)["model_config"]
        return family_of(mc), int(mc["max_positions"])
    if init is not None:
        return init.family, int(init.config.max_positions)
    return family_of(cfg.model), int(cfg.model.get("max_positions", 2048))


def check_block_size(cfg: DictConfig, regime: Regime) -> None:
    """k is model.block_size alone: regime.block_size reads it (conf/regime), and the base model has one head."""
    k = int(cfg.model.block_size)
    if regime.block_size != k:
        raise TrainError(
            f"regime.block_size={regime.block_size}: the number of heads is set as model.block_size "
            "(regime.block_size reads it)"
        )
    if regime.stage == "base" and k != 1:
        raise TrainError(
            f"model.block_size={k}: regime base trains the base model, head 1 alone; k is for the head "
            "regimes (+regime=frozen|finetune|distill|both|self)"
        )


def base_model_config(cfg: DictConfig, tokenizer):
    """conf/model with this run's tokenizer: the config of a model trained from scratch (regime base)."""
    m = {k: v for k, v in plain(cfg.model).items() if k != "vocab_size"}
    return family_of(m).config_from_train_cfg(m, tokenizer)


def heads_model_config(init_config, cfg: DictConfig):
    """The base model's config with the head fields from this run, k among them (the heads are new; the backbone is
    copied)."""
    m = plain(cfg.model)
    over = {f: m[f] for f in family_of(init_config).head_fields if f in m}
    over["block_size"] = int(over["block_size"])
    return dataclasses.replace(init_config, **over)


def copy_weights(dst: BPDModel, src: BPDModel) -> dict[str, list[str]]:
    """Copy every tensor of `src` whose name and shape `dst` shares. The backbone must copy completely;
    head tensors of another k (or none, from a base model) stay freshly initialised."""

    def head_names(m: BPDModel) -> set[str]:
        ids = {id(p) for p in m.head_parameters()}
        return {n for n, p in m.named_parameters() if id(p) in ids}

    dst_heads, src_heads = head_names(dst), head_names(src)
    dst_sd, src_sd = dst.state_dict(), src.state_dict()
    load, skipped = {}, []
    for n, v in src_sd.items():
        if n in dst_sd and dst_sd[n].shape == v.shape:
            load[n] = v
        elif n in src_heads or n in dst_heads:
            skipped.append(n)
        else:
            raise TrainError(
                f"init_from tensor {n} {tuple(v.shape)} does not fit the new model "
                f"{tuple(dst_sd[n].shape) if n in dst_sd else '(absent)'}"
            )
    missing = sorted(set(dst_sd) - set(load))
    bad = [n for n in missing if n not in dst_heads]
    if bad:
        raise TrainError(f"init_from lacks backbone tensors {bad[:5]}{'...' if len(bad) > 5 else ''}")
    dst.load_state_dict(load, strict=False)
    return {"copied": sorted(load), "new": missing, "skipped": skipped}


def resolve_resume(cfg: DictConfig, run_dir: Path) -> str | None:
    ck = cfg.get("ckpt_path")
    if ck in (None, "", "null", "none"):
        return None
    if ck == "last":
        p = run_dir / "checkpoints" / "last.ckpt"
        if not p.exists():
            raise TrainError(f"ckpt_path=last but {p} does not exist; start without ckpt_path")
        return str(p)
    if ck == "hpc":
        return "hpc"
    p = Path(str(ck)).expanduser()
    if not p.exists():
        raise TrainError(f"ckpt_path {p} does not exist")
    return str(p)


def build_module(
    cfg: DictConfig, regime: Regime, tokenizer, resume: str | None = None, init: Any = None
) -> BPDLightningModule:
    """The LightningModule for this regime, with the backbone copied from init_from (head regimes; `init`: that
    model if the caller loaded it already). When resuming, the model config comes from the checkpoint and the
    weights are left to Lightning."""
    opened = init
    init_from = regime.init_from
    init = None
    if resume and resume != "hpc" and Path(resume).is_file():
        from bpd_train.sources.loading import check_tokenizer

        ckpt = read_checkpoint(resume)
        try:
            meta = checkpoint_meta(ckpt, resume)
        except CheckpointError as e:
            raise TrainError(str(e)) from None
        check_tokenizer(
            resume, meta.get("tokenizer_hash"), "this run", tokenizer.path, tokenizer.hash, error=TrainError
        )

        model_cfg = config_from_dict(dict(meta["model_config"]))
    elif init_from:
        init = load_init(init_from, tokenizer, opened)
        model_cfg = heads_model_config(init.config, cfg)
    else:
        model_cfg = base_model_config(cfg, tokenizer)
    module = BPDLightningModule(
        model_config=model_cfg.to_dict(),
        regime=regime.to_dict(),
        optim=plain(cfg.optim),
        loss=plain(cfg.loss),
        seed=int(cfg.seed),
        tokenizer_file=str(Path(tokenizer.path).resolve()),
        tokenizer_hash=tokenizer.hash,
        data_name=str(cfg.data.name),
        init_from=(init.source.spec or str(init.source)) if init is not None else init_from,
        tokenizer_meta=tokenizer.meta,
    )
    if init is not None:
        report = copy_weights(module.model, init.model)
        log.info(
            "init_from %s: copied %d tensors, %d new head tensors, %d skipped",
            init.source,
            len(report["copied"]),
            len(report["new"]),
            len(report["skipped"]),
        )
    if module.kd_weight > 0:
        module.attach_teacher(kd_teacher(cfg, regime, tokenizer, init))
    return module


def kd_teacher(cfg: DictConfig, regime: Regime, tokenizer, init: Any = None) -> Any:
    """The frozen teacher of word-level distillation (loss.kd_weight > 0): loss.kd_teacher, else the model the
    run starts from (regime.init_from). Loaded again on resume: it is never stored in a checkpoint."""
    spec = cfg.loss.get("kd_teacher") or regime.init_from
    if not spec:
        raise TrainError("loss.kd_weight > 0 needs a teacher: a head regime's init_from, or loss.kd_teacher=PATH")
    if init is not None and str(spec) == str(regime.init_from):
        return init.model  # module.model holds copies of its tensors, so this stays the starting model
    return load_init(str(spec), tokenizer).model


def check_kd_settings(cfg: DictConfig) -> None:
    """loss.kd_* before anything loads. The KD teacher lives outside the module tree, which FSDP and DeepSpeed
    shard, cast and wrap; only single-device and DDP runs are supported (each rank keeps a full frozen copy)."""
    loss = cfg.get("loss") or {}
    try:
        lam, _ = kd_settings(loss)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if lam == 0:
        return
    target = str((cfg.get("strategy") or {}).get("_target_", ""))
    if "FSDP" in target or "DeepSpeed" in target:
        raise TrainError(
            f"loss.kd_weight > 0 (word-level distillation) is supported with strategy=auto or ddp, "
            f"not {target.rsplit('.', 1)[-1]}; use strategy=ddp or set loss.kd_weight=0"
        )


# ------------------------------------------------------------------------------------------------ main
def own_tokenizer(regime: Regime, resume: str | None) -> tuple[Any, Any]:
    """(the init_from model when it is loaded here, the tokenizer the data must use when a model brings its own
    (hf:...), else None). Loaded before the data: that model decides how the corpus is tokenized."""
    from bpd_train.sources.loading import load

    if resume and resume != "hpc" and Path(resume).is_file():
        meta = checkpoint_meta(read_checkpoint(resume), resume)
        return None, load(resume).data_tokenizer() if meta.get("tokenizer_meta") else None
    if not regime.init_from:
        return None, None
    init = open_init(regime.init_from)
    return init, init.data_tokenizer()


def write_run_folder(cfg: DictConfig, run_dir: Path, tokenizer) -> None:
    """tokenizer.model (an imported model's tokenizer: its files in tokenizer/) and the resolved config.yaml
    beside the checkpoints (rank zero)."""
    if not is_rank_zero():
        return
    from bpd_train.sources.loading import TOKENIZER_DIR

    run_dir.mkdir(parents=True, exist_ok=True)
    src = Path(tokenizer.path)
    if src.is_dir():
        copies = [(src / name, run_dir / TOKENIZER_DIR / name) for name in tokenizer_files(src)]
        (run_dir / TOKENIZER_DIR).mkdir(exist_ok=True)
    else:
        copies = [(src, run_dir / "tokenizer.model")]
    for a, b in copies:
        data = a.read_bytes()
        if not b.is_file() or b.read_bytes() != data:
            atomic_write_bytes(b, data)
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))


def train(cfg: DictConfig, **trainer_overrides) -> Path:
    """Train one regime; returns its run folder."""
    if cfg.get("regime") is None:
        raise TrainError(f"choose a regime: python train.py +regime={{{','.join(available_regimes())}}}")
    try:
        regime = Regime.from_cfg(cfg.regime)
    except ValueError as e:
        raise TrainError(str(e)) from None
    check_block_size(cfg, regime)
    run_dir = Path(str(cfg.run_dir)).expanduser().resolve()
    check_accelerator(cfg)
    check_kd_settings(cfg)
    enable_tf32(str(cfg.trainer.get("accelerator", "auto")))
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    pl.seed_everything(int(cfg.seed), workers=True)
    resume = resolve_resume(cfg, run_dir)
    if (
        resume is None
        and is_rank_zero()
        and (run_dir / "checkpoints").is_dir()
        and any((run_dir / "checkpoints").glob("*.ckpt"))
    ):
        log.warning("%s already holds checkpoints; this fresh run replaces them (ckpt_path=last resumes)", run_dir)

    init, own_tok = own_tokenizer(regime, resume)
    data_regime = self_corpus(cfg, regime) if regime.source == "self" else regime
    family, max_positions = run_family(cfg, init, resume)
    dm = make_datamodule(cfg, data_regime, tokenizer=own_tok, family=family, max_positions=max_positions)
    prepare_data_once(dm, run_dir)
    dm.setup("fit")
    tokenizer = dm.tokenizer
    module = build_module(cfg, regime, tokenizer, resume, init=init)
    write_run_folder(cfg, run_dir, tokenizer)
    resuming = resume is not None or any(default_root_dir(run_dir).glob("hpc_ckpt_*.ckpt"))
    trainer = make_trainer(cfg, run_dir, resuming=resuming, **trainer_overrides)
    done = run_dir / "done.json"  # what `make demo` and later stages read as "this run finished"
    if is_rank_zero():
        done.unlink(missing_ok=True)
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    clear_data_marker(run_dir)
    if is_rank_zero() and not trainer.interrupted:
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") or ""
        atomic_write_text(
            done,
            json.dumps(
                {"global_step": int(trainer.global_step), "best_checkpoint": best, "regime": regime.name}, indent=2
            )
            + "\n",
        )
        # The progress bar leaves no trace of where the run went; say it, and what usually comes next.
        nxt = (
            "python distill.py, then python train.py +regime=frozen|finetune|distill|both"
            if regime.name == "base"
            else "python evaluate.py, then python export.py export.checkpoint=" + str(run_dir)
        )
        print(
            f"\n{regime.name} finished after {int(trainer.global_step)} steps: {run_dir}\n"
            f"  best checkpoint: {best or '-'}\n  next: {nxt} (with the same experiment=/overrides)",
            flush=True,
        )
    return run_dir
