"""What both model families share, written once: the config dataclasses' dict round trip (`ModelConfig`) and the
head interface of the models (`HeadedModel`: k, the parameter groups regimes freeze by, the vocabulary projection,
what the decode engine reads off a model as data: `decoder_only`). Decode state (options, packed weights) is
not kept here: a decoder owns it (engine/weights.py PackedWeights, decoding/serving.py Decoder)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn


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

    decoder_only = False  # which family's step weights the decode engine builds (engine/weights.py)

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
