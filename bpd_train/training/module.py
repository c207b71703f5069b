"""The one LightningModule for every regime: base, frozen, finetune, distill, both, self.

What differs between regimes is data (bpd_train.training.regimes.Regime): which parameters train, which
heads enter the loss and how they are weighted. The constructor takes plain Python types only, so
`BPDLightningModule.load_from_checkpoint(path)` rebuilds it and `torch.load(weights_only=True)` reads the file.
"""

from __future__ import annotations

import hashlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from bpd_train.families import family_of
from bpd_train.model import build_model
from bpd_train.sources.checkpoint import CKPT_META_KEY
from bpd_train.sources.zero import FROZEN_FP32_KEY
from bpd_train.training.feature_cache import FeatureCache
from bpd_train.training.losses import bpd_loss, check_p1_weight, head_stats, head_weights, kd_settings
from bpd_train.training.optim import build_optimizer, param_groups
from bpd_train.training.regimes import Regime


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from integers (seed, rank, step, ...), identical on every machine."""
    h = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class BPDLightningModule(pl.LightningModule):
    def __init__(
        self,
        model_config: dict[str, Any],
        regime: dict[str, Any],
        optim: dict[str, Any],
        loss: dict[str, Any] | None = None,
        seed: int = 0,
        tokenizer_file: str | None = None,
        tokenizer_hash: str | None = None,
        data_name: str | None = None,
        init_from: str | None = None,
        tokenizer_meta: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(dict(model_config))  # the config's family builds it (BPDModel, LMModel)
        # what a batch holds (src/tgt_in/tgt_out, tokens/targets) is the family's; the targets' padding is
        # cfg.pad_id in either family, so the losses below take it as their ignore id
        self.family = family_of(self.model.config)
        self.regime = Regime.from_cfg(regime)
        self.loss_cfg = dict(loss or {})
        if self.loss_cfg.get("p1_weight") is not None:
            check_p1_weight(self.loss_cfg["p1_weight"])  # a bad value fails here, not at the first step
        # Word-level distillation for head 1 (loss.kd_weight = λ > 0): a frozen teacher's distribution at every
        # target position (attach_teacher; training only, never part of a checkpoint).
        self.kd_weight, self.kd_temperature = kd_settings(self.loss_cfg)
        targets = str(self.loss_cfg.get("head_targets", "data"))
        if targets not in ("data", "self"):
            raise ValueError(
                f"loss.head_targets={targets!r}; choose data (the corpus's tokens) or self (heads 2..k "
                "learn head 1's own choices)"
            )
        self.self_targets = targets == "self"
        # loss.self_kd_weight = μ: heads 2..k also learn head 1's own distribution where they look ahead (losses.py)
        self.self_kd_weight = float(self.loss_cfg.get("self_kd_weight") or 0.0)
        if not 0.0 <= self.self_kd_weight <= 1.0:
            raise ValueError(f"loss.self_kd_weight must be in [0, 1], got {self.self_kd_weight}")
        # loss.draft_lowest_ids = N: heads 2..k learn to choose among the N lowest ids only, the draft vocabulary
        # they propose from when decoding (decode.draft_top_tokens); a softmax over N ids instead of the whole
        # vocabulary (with self_kd_weight, head 1's soft labels are its softmax over the same N ids).
        # (loss.draft_vocab, its old name, is read too: a checkpoint's hyperparameters may hold it.)
        self.draft_vocab = int(self.loss_cfg.get("draft_lowest_ids") or self.loss_cfg.get("draft_vocab") or 0)
        self.seed = int(seed)
        cfg = self.model.config
        if self.draft_vocab:
            if not 0 < self.draft_vocab <= cfg.vocab_size:
                raise ValueError(
                    f"loss.draft_lowest_ids={self.draft_vocab}: the number of lowest ids heads 2..k choose "
                    f"among, 1..{cfg.vocab_size} (or null: every id)"
                )
            # (self_kd_weight works with it: head 1's soft labels are its distribution over the same ids)
            if not self.regime.freeze_backbone or self.kd_weight > 0 or not hasattr(self.model, "head_states"):
                raise ValueError(
                    "loss.draft_lowest_ids trains heads 2..k alone on a frozen decoder-only backbone "
                    "(regimes frozen, distill), without kd_weight"
                )
        if self.regime.freeze_backbone:
            for p in self.model.backbone_parameters():
                p.requires_grad_(False)
        # Heads whose loss can train something: with a frozen backbone and identity_p1, head 1 has no
        # trainable parameter on its path, so it never enters the loss.
        first = 1 if (self.regime.freeze_backbone and cfg.identity_p1) else 0
        self.train_heads = list(range(first, cfg.block_size))
        if not self.train_heads:
            raise ValueError(f"regime {self.regime.name}: no head has trainable parameters (k={cfg.block_size})")
        if self.kd_weight > 0 and 0 not in self.train_heads:
            raise ValueError(
                f"loss.kd_weight distils into head 1, which does not train in regime {self.regime.name}; "
                f"set loss.kd_weight=0"
            )
        # Kept out of the module tree (a plain attribute, not a submodule): not in state_dict or checkpoints, not
        # in the optimiser, not wrapped or synchronised by DDP; train()/eval() and .to() do not reach it.
        object.__setattr__(self, "_teacher", None)
        # fp32 values of the frozen parameters where the strategy keeps none (keep_frozen_fp32); plain attribute
        object.__setattr__(self, "_frozen_fp32", None)
        # the frozen backbone's hidden states per training row, reused across epochs (training/feature_cache.py):
        # where the backbone is frozen and has no dropout, and the family names a batch's rows
        gb = float(self.regime.feature_cache_gb)
        cache = None
        if (
            self.regime.freeze_backbone
            and gb > 0
            and self.family.row_features
            and float(getattr(cfg, "dropout", 0.0) or 0.0) == 0.0
        ):
            cache = FeatureCache(cfg.pad_id, int(gb * 2**30))
        object.__setattr__(self, "_feature_cache", cache)
        self._val: dict[str, torch.Tensor] | None = None
        self._kd_stat: torch.Tensor | None = None  # the last step's KL term, for the log

    # ------------------------------------------------------------------------------------------- steps
    def heads_for_step(self, batch_idx: int) -> tuple[list[int], list[float]]:
        """Heads entering this step's loss and their weights. `random` draws one head from (seed, step,
        micro-batch): the same on every rank and after a resume."""
        mode = self.regime.head_loss
        heads = self.train_heads
        p1 = self.loss_cfg.get("p1_weight")
        if mode == "random" and len(heads) > 1:
            accum = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
            r = mix_seed(self.seed, 7919, self.global_step, batch_idx % max(1, accum))
            if p1 is not None and heads[0] == 0:  # head 1 drawn with probability p1_weight, the others evenly
                draw = (r % 1_000_000) / 1_000_000
                heads = [0] if draw < check_p1_weight(p1) else [heads[1 + (r // 1_000_000) % (len(heads) - 1)]]
            else:
                heads = [heads[r % len(heads)]]
        weights = head_weights(
            mode, heads, self.loss_cfg.get("head_weights"), self.loss_cfg.get("head_weight_decay", 0.8), p1
        )
        return heads, weights

    def attach_teacher(self, teacher: torch.nn.Module) -> None:
        """The frozen model whose head-1 distribution head 1 learns when loss.kd_weight > 0 (run.build_module
        passes the init_from model, or loss.kd_teacher; rebuilt the same way on resume)."""
        if getattr(teacher.config, "vocab_size", None) != self.model.config.vocab_size:
            raise ValueError(
                f"the KD teacher's vocabulary ({teacher.config.vocab_size}) is not the student's "
                f"({self.model.config.vocab_size})"
            )
        teacher.eval()
        teacher.requires_grad_(False)
        object.__setattr__(self, "_teacher", teacher)

    def _hidden(self, batch: dict[str, torch.Tensor], model: torch.nn.Module | None = None) -> torch.Tensor:
        return self.family.features(self.model if model is None else model, batch)

    @torch.no_grad()
    def teacher_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B,T,V] the teacher's next-token logits, teacher-forced on this batch (eval mode: no dropout)."""
        t = self._teacher
        if t is None:
            raise RuntimeError("loss.kd_weight > 0 but no teacher is attached (BPDLightningModule.attach_teacher)")
        dev = self._targets(batch).device
        if next(t.parameters()).device != dev:
            t.to(dev)
        t.eval()
        return t.head_logits(self._hidden(batch, t), 0)

    def _features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.regime.freeze_backbone and self.training:
            # The frozen backbone needs no graph: only the heads get gradients. Its hidden states come from the
            # feature cache once a row has been seen (where there is one), else they are computed here.
            with torch.no_grad():
                if self._feature_cache is not None:
                    return self._feature_cache.features(self.family.feature_rows(batch), lambda: self._hidden(batch))
                return self._hidden(batch)
        return self._hidden(batch)

    def _targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.family.targets(batch)

    def _batch_size(self, batch: dict[str, torch.Tensor]) -> int:
        return self.family.batch_size(batch)

    def compute_loss(self, batch: dict[str, torch.Tensor], heads: list[int], weights: list[float]):
        cfg = self.model.config
        h = self._features(batch)
        kd = self.kd_weight > 0 and 0 in heads
        extras: dict[str, torch.Tensor] = {}
        head_logits, targets = self.model.head_logits, self._targets(batch)
        chain = getattr(self.model, "chained", False)
        prev_series = None
        if self.draft_vocab:  # heads 2..k only (head 1 does not train on a frozen backbone): the lowest ids
            w = self.model.output_weight()[: self.draft_vocab]

            def head_logits(x, i, prev=None):
                return F.linear(self.model.head_states(x, i, i + 1, prev).squeeze(-2), w)

            full = targets
            targets = targets.masked_fill(targets >= self.draft_vocab, cfg.pad_id)
            # chained heads read the token before their target whatever its id (head 1's is the model's own)
            h, targets, prev_series = compact_rows(h, targets, max(heads), cfg.pad_id, full)
            if not chain:
                prev_series = None
        loss, per_head = bpd_loss(
            head_logits,
            h,
            targets,
            heads,
            weights,
            cfg.pad_id,
            float(self.loss_cfg.get("label_smoothing", 0.0)),
            bool(self.loss_cfg.get("recompute", True)),
            teacher_logits=self.teacher_logits(batch) if kd else None,
            kd_weight=self.kd_weight if kd else 0.0,
            kd_temperature=self.kd_temperature,
            extras=extras,
            self_targets=self.self_targets,
            self_kd_weight=self.self_kd_weight,
            chain=chain,
            prev_series=prev_series,
        )
        self._kd_stat = extras.get("kd")
        if cfg.block_size > 1 and cfg.identity_p1 and heads == [0]:
            # Head 1 alone does not reach the BPD layer; a zero-weighted touch keeps DDP's gradient
            # reduction (and AdamW's step) the same whichever head was drawn. It runs the heads themselves on one
            # position rather than reading their parameters: under ZeRO-3 a parameter read outside a forward is
            # an empty shard, whose gradient DeepSpeed cannot reduce.
            heads_mod = self.model.heads
            if getattr(heads_mod, "chained", False):
                e = self.model.embed_prev(self._targets(batch)[:, :1])
                touch = torch.stack([heads_mod.state(h[:, :1], i, e) for i in range(1, cfg.block_size)])
            else:
                touch = heads_mod.states(h[:, :1], 1, cfg.block_size)
            loss = loss + 0.0 * touch.sum()
        return loss, per_head

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        heads, weights = self.heads_for_step(batch_idx)
        loss, per_head = self.compute_loss(batch, heads, weights)
        bs = self._batch_size(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=bs)
        for i, li in per_head.items():
            self.log(f"train/loss_head{i + 1}", li, on_step=True, on_epoch=False, batch_size=bs)
        if self._kd_stat is not None:
            self.log("train/kd_head1", self._kd_stat, on_step=True, on_epoch=False, batch_size=bs)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Dropout masks as a function of (seed, rank, step): a run resumed from a checkpoint draws exactly
        # what the uninterrupted run drew, whatever consumed the global RNG in between (dataloader
        # iterators, validation, callbacks).
        accum = max(1, self.trainer.accumulate_grad_batches)
        torch.manual_seed(mix_seed(self.seed, self.global_rank, self.global_step, batch_idx % accum))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Reaching max_steps between two validations: ask for a stop, which makes Lightning validate (and
        # ModelCheckpoint save best/last) on the final weights.
        t = self.trainer
        if (
            t.max_steps
            and t.max_steps > 0
            and self.global_step >= t.max_steps
            and (batch_idx + 1) % max(1, t.accumulate_grad_batches) == 0
        ):
            t.should_stop = True

    def on_train_epoch_start(self) -> None:
        # Lightning only calls set_epoch on samplers it knows; the token-bucket batch sampler reshuffles
        # per epoch through its own set_epoch (a no-op for the epoch it already holds, so resume is safe).
        loaders = self.trainer.train_dataloader
        for dl in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            bs = getattr(dl, "batch_sampler", None)
            if bs is not None and hasattr(bs, "set_epoch"):
                bs.set_epoch(self.current_epoch)

    # ------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        self._val = None

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        cfg = self.model.config
        h = self._hidden(batch)
        stats = head_stats(
            self.model.head_logits,
            h,
            self._targets(batch),
            cfg.block_size,
            cfg.pad_id,
            float(self.loss_cfg.get("label_smoothing", 0.0)),
            chain=getattr(self.model, "chained", False),
        )
        if self._val is None:
            self._val = stats
        else:
            for key, v in stats.items():
                self._val[key] += v

    def on_validation_epoch_end(self) -> None:
        k = self.model.config.block_size
        if self._val is None:  # this rank saw no batch: contribute zeros to the reduction
            z = torch.zeros(k, dtype=torch.float64, device=self.device)
            one = torch.zeros(1, dtype=torch.float64, device=self.device)
            self._val = {
                "loss_sum": z,
                "count": z.clone(),
                "correct": z.clone(),
                "accepted_sum": one,
                "positions": one.clone(),
            }
        s = {key: self.trainer.strategy.reduce(v, reduce_op="sum") for key, v in self._val.items()}
        count = s["count"].clamp_min(1)
        loss = s["loss_sum"] / count
        acc = s["correct"] / count
        metrics = {
            "val/loss": loss.mean(),
            "val/expected_accepted": s["accepted_sum"][0] / s["positions"][0].clamp_min(1),
        }
        for i in range(k):
            metrics[f"val/loss_head{i + 1}"] = loss[i]
            metrics[f"val/acc_head{i + 1}"] = acc[i]
        self.log_dict({n: v.float() for n, v in metrics.items()}, on_step=False, on_epoch=True, sync_dist=False)
        self._val = None

    # ------------------------------------------------------------------------------------- optimiser
    def configure_optimizers(self) -> dict[str, Any]:
        from hydra.utils import instantiate

        optim = dict(self.hparams.optim)
        factory = instantiate(dict(optim["optimizer"]))  # functools.partial(torch.optim.AdamW, lr=..., ...)
        kw = getattr(factory, "keywords", {})
        groups = param_groups(
            self.model.backbone_parameters(),
            self.model.head_parameters(),
            lr=float(kw.get("lr", 1e-3)),
            weight_decay=float(kw.get("weight_decay", 0.0)),
            head_lr_mult=float(optim.get("head_lr_mult", 1.0)),
        )
        total = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        if total is None:
            try:
                total = int(self.trainer.estimated_stepping_batches)
            except Exception:  # noqa: BLE001 - only the cosine schedule needs it
                total = None
        return build_optimizer(factory, groups, dict(optim.get("schedule", {})), total)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Lightning refuses norm clipping under FSDP (clip_grad_norm_ over local shards gives a wrong norm) and
        # stops at the first step; FSDP's own clip_grad_norm_ on the root module reduces the norm across ranks.
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = self.trainer.model
        if (
            isinstance(root, FullyShardedDataParallel)
            and gradient_clip_val
            and (gradient_clip_algorithm or "norm") == "norm"
        ):
            root.clip_grad_norm_(float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self) -> dict[str, Any]:
        hp = self.hparams
        return {
            "model_config": self.model.config.to_dict(),
            "tokenizer_hash": hp.get("tokenizer_hash"),
            "tokenizer_file": hp.get("tokenizer_file"),
            "tokenizer_meta": hp.get("tokenizer_meta"),
            "regime": self.regime.name,
            "paper_regime": self.regime.paper_name,
            "block_size": self.model.config.block_size,
            "head_loss": self.regime.head_loss,
            "trainable": self.regime.trainable,
            "source": self.regime.source,
            "data": hp.get("data_name"),
            "init_from": hp.get("init_from"),
            "seed": self.seed,
            "global_step": int(self.global_step) if self._trainer is not None else 0,
        }

    def setup(self, stage: str) -> None:
        # Before the strategy wraps the model: DeepSpeed with bf16/fp16 casts every parameter and keeps an fp32
        # master copy only of the trainable ones, so a frozen backbone would be saved rounded for good.
        from lightning.pytorch.strategies import DeepSpeedStrategy

        trainer = self._trainer
        if (
            stage == "fit"
            and trainer is not None
            and isinstance(trainer.strategy, DeepSpeedStrategy)
            and not str(trainer.precision).startswith(("32", "64"))
        ):
            self.keep_frozen_fp32()

    def keep_frozen_fp32(self) -> None:
        """Keep the fp32 values of the frozen parameters (on CPU, rank 0 only: it writes the checkpoint that
        consolidation reads) so that checkpoints carry them unrounded (on_save_checkpoint; zero.py restores them)."""
        frozen = {
            n: p.detach().to("cpu", torch.float32, copy=True)
            for n, p in self.model.named_parameters()
            if not p.requires_grad
        }
        object.__setattr__(self, "_frozen_fp32", frozen if frozen and self.global_rank == 0 else None)

    def frozen_fp32_state(self) -> dict[str, torch.Tensor]:
        return dict(self._frozen_fp32 or {})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CKPT_META_KEY] = self.checkpoint_meta()
        if self._frozen_fp32:
            checkpoint[FROZEN_FP32_KEY] = self._frozen_fp32

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a resumed run keeps the values it started from; a checkpoint without them leaves none (setup captured
        # this module's fresh initialisation, not the backbone the checkpoint holds)
        if self._frozen_fp32 is not None:
            kept = checkpoint.get(FROZEN_FP32_KEY)
            object.__setattr__(self, "_frozen_fp32", dict(kept) if isinstance(kept, dict) and kept else None)


def compact_rows(h: torch.Tensor, targets: torch.Tensor, reach: int, pad_id: int, also: torch.Tensor | None = None):
    """h [B,T,D] and targets [B,T] with each row shifted left to the first position from which a head up to `reach`
    ahead has a target, and cut after the row's last target: the same (state, target-i-ahead) pairs for every head
    i <= reach, so the same loss, over fewer positions. A prompt's and the padding's positions have no target, and
    the heads' projection over them was most of a decoder-only batch's cost. also [B,T]: a second series
    compacted the same way (returned third)."""
    valid = targets.ne(pad_id)
    t = targets.size(1)
    pos = torch.arange(t, device=targets.device)
    first = torch.where(valid, pos, t).min(1).values
    last = torch.where(valid, pos, -1).max(1).values
    start = (first - int(reach)).clamp_min(0)
    length = (last + 1 - start).clamp_min(0)
    width = max(int(length.max()), 1)
    cols = torch.arange(width, device=targets.device)
    idx = (start[:, None] + cols[None, :]).clamp_max(t - 1)
    cut = cols[None, :] >= length[:, None]
    out_t = targets.gather(1, idx).masked_fill(cut, pad_id)
    out_h = h.gather(1, idx[..., None].expand(-1, -1, h.size(-1)))
    if also is None:
        return out_h, out_t
    return out_h, out_t, also.gather(1, idx).masked_fill(cut, pad_id)
