"""FSDP on CPU, through Lightning: `strategy=fsdp` with `trainer=cpu` (gloo), for trying an FSDP config and
testing the FSDP paths (sharded checkpoints, in-training evaluation) without a GPU.

Lightning refuses FSDP on a CPU accelerator, but only for the exact FSDPStrategy class (an accelerator-connector
check); PyTorch's FSDP itself shards and gathers over gloo on CPU once it is told the device
(device_id=cpu; Lightning passes root_device.index, which is None on CPU, and FSDP then looks for a GPU).
One more CPU difference: a full state dict with offload_to_cpu=True (Lightning's choice, right for GPU memory)
crashes when the parameters already live on the CPU (torch 2.13), so while this strategy saves or loads, the
full-state-dict context is built with offload_to_cpu=False. Everything else -- sharding, state dicts,
checkpoints -- is Lightning's and PyTorch's own code. run.make_strategy picks this class for strategy=fsdp on
trainer.accelerator=cpu.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import lightning.pytorch.strategies.fsdp as pl_fsdp
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.nn import Module


def _full_state_dict_context_on_cpu(module: Module, world_size: int, rank0_only: bool = True):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    return FSDP.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )


@contextlib.contextmanager
def _no_offload():
    original = pl_fsdp._get_full_state_dict_context
    pl_fsdp._get_full_state_dict_context = _full_state_dict_context_on_cpu
    try:
        yield
    finally:
        pl_fsdp._get_full_state_dict_context = original


def _without_offload(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with _no_offload():
            return method(self, *args, **kwargs)

    return wrapper


class CPUFSDPStrategy(FSDPStrategy):
    strategy_name = "fsdp_cpu"

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(*args, **kwargs)

    def _setup_model(self, model: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            # what FSDPStrategy._setup_model does, with the device named; it then skips its own wrapping
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
        return super()._setup_model(model)

    lightning_module_state_dict = _without_offload(FSDPStrategy.lightning_module_state_dict)
    optimizer_state = _without_offload(FSDPStrategy.optimizer_state)
    load_checkpoint = _without_offload(FSDPStrategy.load_checkpoint)
