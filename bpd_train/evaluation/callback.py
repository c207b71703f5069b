"""BlockwiseEval: at the end of each validation, blockwise-decode a fixed validation subset and log
val/bleu, val/mean_accepted (k̂), val/speedup (and val/agreement with greedy).

Cheap by design: a small evenly spaced subset (n_sentences; training's config: 128), collected once from the
validation dataloader (sources as fed to the model, references decoded from the gold targets), decoded on rank 0
only (its values logged on every rank). A model without heads (k = 1) is decoded greedily: val/bleu is then its
greedy BLEU, by which checkpoint.monitor=val/bleu selects the base model's best.ckpt.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from bpd_train.data.sampler import evenly_spaced
from bpd_train.decoding.common import DEFAULT_MAX_LEN
from bpd_train.decoding.settings import max_len_arg, parse_rule
from bpd_train.evaluation.compare import Batches, compare
from bpd_train.evaluation.metrics import corpus_scores
from bpd_train.families import family_of
from bpd_train.model import build_model

log = logging.getLogger(__name__)


def _gather_context(trainer, model):
    """None when every rank holds the full weights (single process, DDP, ZeRO-1/2); else a context in which
    they are gathered (on rank 0 at least). Under ZeRO-3 and FSDP the parameters are sharded across ranks and
    decoding runs outside the strategy's forward hooks (which gather them only for a module's own forward)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        # rank0_only: the other ranks take part in the gather but never hold the full weights
        return FullyShardedDataParallel.summon_full_params(strategy.model, writeback=False, rank0_only=True)
    return None


def _full_state(model) -> dict:
    """The model's parameters and buffers under their own names (FSDP's per-layer units put a wrapper prefix in)."""
    from itertools import chain

    strip = "_fsdp_wrapped_module."
    return {n.replace(strip, ""): t.detach().clone() for n, t in chain(model.named_parameters(), model.named_buffers())}


def _decoding_model(trainer, model):
    """The model to decode with: itself, or -- where its weights are sharded (or cast to bf16/fp16 by DeepSpeed) --
    on rank 0 a plain fp32 copy of the gathered weights (inside the model every module call would re-shard them),
    on the other ranks None. Gathering
    is a collective, so every rank must call this."""
    ctx = _gather_context(trainer, model)
    if ctx is None:
        if all(p.dtype == torch.float32 for p in model.parameters()):
            return model
        # DeepSpeed's bf16/fp16 engine cast the parameters in place; the decoders run fp32 weights
        ctx = contextlib.nullcontext()
    with ctx:
        if getattr(trainer, "global_rank", 0) != 0:
            return None  # only rank 0 decodes: the others never build a copy
        copy = build_model(model.config)  # either family (encoder-decoder or decoder-only)
        state = _full_state(model)
        missing = set(copy.state_dict()) - set(state)
        if missing:
            raise RuntimeError(f"BlockwiseEval: the gathered weights lack {sorted(missing)[:5]}")
        copy.load_state_dict({k: v for k, v in state.items() if k in copy.state_dict()})
    return copy.to(next(model.parameters()).device)


class BlockwiseEval(Callback):
    def __init__(
        self,
        enabled: Any = "auto",
        n_sentences: int = 32,
        batch_size: int = 16,
        block_size: int | None = None,
        accept: str = "exact",
        max_len: Any = DEFAULT_MAX_LEN,
        every_n_validations: int = 1,
        warmup: int = 1,
    ):
        """enabled: True | False | "auto" (on when the model has heads, k > 1); block_size: None = the model's k."""
        super().__init__()
        self.enabled = enabled
        self.n_sentences = int(n_sentences)
        self.batch_size = int(batch_size)
        self.block_size = block_size
        self.accept = accept
        self.max_len = max_len
        self.every = max(1, int(every_n_validations))
        self.warmup = int(warmup)
        self._subset: tuple[list[list[int]], list[str]] | None = None
        self._count = 0

    # --------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _tokenizer(trainer, pl_module):
        dm = getattr(trainer, "datamodule", None)
        tok = getattr(dm, "tokenizer", None) or getattr(pl_module, "tokenizer", None)
        if tok is None:
            raise RuntimeError("BlockwiseEval needs a tokenizer on the datamodule (or the LightningModule)")
        return tok

    def _collect(self, trainer, tok, cfg) -> tuple[list[list[int]], list[str]]:
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "val_dataloader"):
            loader = dm.val_dataloader()
        else:
            loaders = trainer.val_dataloaders
            loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        rows = []
        family = family_of(cfg)
        for batch in loader:
            for key, s, t in family.reference_rows(batch, cfg):
                rows.append((len(rows) if key is None else key, s, t))
        rows.sort(key=lambda x: x[0])
        picks = evenly_spaced(len(rows), self.n_sentences)
        decode = tok.decode if hasattr(tok, "decode") else tok.sp.decode
        return [rows[i][1] for i in picks], [decode(rows[i][2]) for i in picks]

    # ---------------------------------------------------------------------------------------------- hooks
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.enabled is False or str(self.enabled).lower() == "false":
            return
        model = pl_module.model
        cfg = model.config
        if str(self.enabled).lower() == "auto" and cfg.block_size <= 1:
            return
        self._count += 1
        if (self._count - 1) % self.every:
            return
        decode_model = _decoding_model(trainer, model)  # on every rank: gathering sharded weights is collective
        metrics = self.evaluate(trainer, pl_module, decode_model) if trainer.global_rank == 0 else None
        several = int(getattr(trainer, "world_size", 1)) > 1
        if several:
            # rank 0's values on every rank: a ModelCheckpoint monitoring val/bleu decides on each rank
            metrics = trainer.strategy.broadcast(metrics, src=0)
        for name, value in (metrics or {}).items():
            pl_module.log(
                name,
                value,
                rank_zero_only=not several,
                prog_bar=name == "val/mean_accepted",
                batch_size=self.n_sentences,
            )

    @torch.no_grad()
    def evaluate(self, trainer, pl_module, model=None) -> dict[str, float]:
        model = pl_module.model if model is None else model
        cfg = model.config
        tok = self._tokenizer(trainer, pl_module)
        if self._subset is None:
            self._subset = self._collect(trainer, tok, cfg)
        srcs, refs = self._subset
        if not srcs:
            return {}
        k = min(self.block_size or cfg.block_size, cfg.block_size)
        rule, max_len = parse_rule(self.accept), max_len_arg(self.max_len)
        device = next(model.parameters()).device
        batches = Batches.of(srcs, self.batch_size, cfg.pad_id, device)
        was_training = model.training
        model.eval()
        try:
            c = compare(model, batches, k=k, rule=rule, max_len=max_len, device=device, warmup=self.warmup)
        finally:
            model.train(was_training)
        out_run = c.blockwise or c.greedy
        decode = tok.decode if hasattr(tok, "decode") else tok.sp.decode
        scores = corpus_scores([decode(t) for t in out_run.tokens], refs)
        out = {
            "val/bleu": scores["bleu"],
            "val/mean_accepted": c.blockwise.stats.mean_accepted if c.blockwise else 1.0,
            "val/speedup": c.speedup if c.blockwise is None or c.blockwise.seconds > 0 else 1.0,
            "val/agreement": c.agreement,
        }
        log.info(
            "blockwise eval (%d sentences, k=%d %s): %s",
            len(srcs),
            k,
            self.accept,
            ", ".join(f"{n}={v:.3f}" for n, v in out.items()),
        )
        return out
