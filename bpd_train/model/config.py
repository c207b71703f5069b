"""Model configuration: a plain dataclass so it round-trips through JSON, checkpoints and Hydra."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BPDConfig:
    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    max_positions: int = 1024
    block_size: int = 1          # k: number of BPD heads (1 = plain Transformer)
    head_d_hidden: int | None = None  # per-head hidden size of the BPD FFN (paper: d_hidden = d_ff); total k*head_d_hidden
    identity_p1: bool = True     # head 1 is the untouched original path
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 3
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.block_size < 1:
            raise ValueError(f"block_size (k) must be >= 1, got {self.block_size}")

    @property
    def head_hidden(self) -> int:
        return self.head_d_hidden if self.head_d_hidden is not None else self.d_ff

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BPDConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown BPDConfig fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)
