"""What both model families share, written once: the config dataclasses' dict round trip (`ModelConfig`) and the
head interface of the models (`HeadedModel`: k, the parameter groups regimes freeze by, the vocabulary projection,
the decode-weight cache's state)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from bpd_train.engine.packed import DecodeOptions


class ModelConfig:
    """Base of a family's config dataclass: plain dicts in and out (JSON, checkpoints, Hydra)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}  # JSON/YAML-plain

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


class HeadedModel(nn.Module):
    """Base of a family's model: a backbone (with `embed` and an optional untied `lm_head`), `heads` (None at k = 1)
    and `config.block_size`, the one place k is kept."""

    def _init_decoding(self) -> None:
        # how decoders run this model (precision, draft vocabulary) and the weights prepared for it
        self.decode_options = DecodeOptions()
        self._decode_cache: tuple | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- parameter groups (regimes freeze by these) ----
    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.heads.parameters()) if self.heads is not None else []

    def backbone_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("heads.")]

    def output_weight(self) -> Tensor:
        """[V,D] vocabulary projection: the (decoder's) token embedding when tied, else the separate lm_head."""
        head = self._modules["lm_head"]
        return (head if head is not None else self._modules["embed"])._parameters["weight"]

    def __getstate__(self):
        # copies and pickles (deepcopy, DDP spawn, checkpoints of the module) never carry packed weights
        state = dict(super().__getstate__())
        state["_decode_cache"] = None
        return state
