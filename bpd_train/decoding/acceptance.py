"""Acceptance rules for blockwise decoding: which proposals head 1 (p1) verifies. The one place a rule is defined,
named in config and labelled in reports.

Each rule maps proposals [R,m], head-1 logits at the positions that predict them [R,m,V] and head-1's
argmax there [R,m] to a bool [R,m]. Blockwise accepts the longest all-True prefix.

Names (configs, evaluate.py, translate --accept; case-insensitive): `exact`; `top<N>` = `topk:<N>` (also
`top-N`, `topk<N>`; bare `topk` is top-1); `distance:<eps>` (also `dist`/`eps` prefixes; bare `distance` is eps 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from bpd_train.decode_settings import RULE_NAMES, rule_spec


class AcceptanceRule:
    label = "?"  # how reports name the rule
    # (top_n, dist_eps) for the engine's native loops (engine/csrc/loops.h LoopModel::accepts), the same verdicts
    # on the same logits; None: a rule they do not know (blockwise takes Python steps)
    native: tuple[int, float] | None = None

    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class Exact(AcceptanceRule):
    """Accept a proposal iff it is head 1's argmax: the output is exactly greedy decoding's."""

    label = "Exact"
    native = (0, -1.0)

    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:
        return proposals == argmax


@dataclass(frozen=True)
class TopK(AcceptanceRule):
    """Accept a proposal iff it lies in head 1's top-n (fewer than n tokens score strictly higher)."""

    n: int = 1

    def __post_init__(self) -> None:
        if int(self.n) < 1:
            raise ValueError(f"TopK needs n >= 1, got {self.n}")

    @property
    def label(self) -> str:
        return f"TopK({self.n})"

    @property
    def native(self) -> tuple[int, float]:
        return int(self.n), -1.0

    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:
        chosen = logits.gather(-1, proposals.unsqueeze(-1))
        return (logits > chosen).sum(-1) < self.n


@dataclass(frozen=True)
class Distance(AcceptanceRule):
    """Accept a proposal iff |proposal - argmax| <= eps (ids of an ordinal vocabulary, e.g. intensities)."""

    eps: float = 0.0

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise ValueError(f"Distance needs eps >= 0, got {self.eps}")

    @property
    def label(self) -> str:
        return f"Distance({self.eps:g})"

    @property
    def native(self) -> tuple[int, float]:
        return 0, float(self.eps)

    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:
        return (proposals - argmax).abs() <= self.eps


NAMES = RULE_NAMES


def make_acceptance(spec) -> AcceptanceRule:
    """An AcceptanceRule as is, or a rule named in the grammar of bpd_train/decode_settings.py `rule_spec` (the
    one parser every option and config goes through; also a dict {"name": ..., "n"/"eps": ...}). Anything else is a
    ValueError that lists the names."""
    if isinstance(spec, AcceptanceRule) or (callable(spec) and hasattr(spec, "label")):
        return spec
    name, arg = rule_spec(spec)
    if name == "topk":
        return TopK(int(arg))
    if name == "distance":
        return Distance(float(arg))
    return Exact()
