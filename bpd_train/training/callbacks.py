"""Training callbacks: throughput, fault injection for resume tests, and the per-checkpoint blockwise eval.

`BlockwiseEval` is owned by evaluation (bpd_train/evaluation/callback.py) and re-exported here, where the
training config (`callbacks.blockwise_eval`) names it.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from lightning.pytorch import Callback

__all__ = ["Throughput", "KillAtStep", "BlockwiseEval"]  # noqa: F822 - BlockwiseEval: module __getattr__


class Throughput(Callback):
    """Logs `train/tokens_per_s`: non-pad target tokens per second of wall clock, summed over all ranks.

    Measured over each logging window (trainer.log_every_n_steps optimiser steps), data loading included.
    """

    def __init__(self, pad_id: int | None = None):
        self.pad_id = pad_id
        self._tokens = 0
        self._t0: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:
            self._sync(pl_module)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pad = self.pad_id if self.pad_id is not None else pl_module.model.config.pad_id
        # target tokens with a loss: a decoder-only model's batch holds "targets" (-1 where no loss applies)
        self._tokens += int(batch["targets" if "targets" in batch else "tgt_out"].ne(pad).sum())
        accum = trainer.accumulate_grad_batches
        at_step_end = (batch_idx + 1) % accum == 0
        every = max(1, trainer.log_every_n_steps)
        if not at_step_end or trainer.global_step % every or self._t0 is None:
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._t0
        tokens = torch.tensor(float(self._tokens), device=pl_module.device)
        tokens = trainer.strategy.reduce(tokens, reduce_op="sum")
        if elapsed > 0:
            pl_module.log(
                "train/tokens_per_s",
                float(tokens) / elapsed,
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
                batch_size=1,
            )
        self._tokens = 0
        self._t0 = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._t0 = None  # validation time is not training time
        self._tokens = 0

    @staticmethod
    def _sync(pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)


class KillAtStep(Callback):
    """SIGKILLs this process when optimiser step `step` begins: a crash without any cleanup, for resume tests
    (`+callbacks.kill._target_=bpd_train.training.callbacks.KillAtStep +callbacks.kill.step=N`)."""

    def __init__(self, step: int):
        self.step = int(step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def __getattr__(name: str):
    # Lazy, so that importing training callbacks does not pull in evaluation (and vice versa).
    if name == "BlockwiseEval":
        from bpd_train.evaluation.callback import BlockwiseEval

        return BlockwiseEval
    raise AttributeError(name)
