"""Acceptance rules for blockwise decoding: which proposals head 1 (p1) verifies. The one place a rule is defined,
named in config and labelled in reports.

Each rule maps proposals [R,m], head-1 logits at the positions that predict them [R,m,V] and head-1's
argmax there [R,m] to a bool [R,m]. Blockwise accepts the longest all-True prefix.

Names (configs, evaluate.py, translate --accept; case-insensitive): `exact`; `top<N>` = `topk:<N>` (also
`top-N`, `topk<N>`; bare `topk` is top-1); `distance:<eps>` (also `dist`/`eps` prefixes; bare `distance` is eps 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor


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


_TOPK = re.compile(r"^top(?:[-_:]?k)?[-_:]?(\d+)$")
_DISTANCE = re.compile(r"^(?:distance|dist|eps)[-_:]?([0-9.]+)$")
NAMES = "exact, top<N> (e.g. top2, topk:2) or distance:<eps>"


def make_acceptance(spec) -> AcceptanceRule:
    """An AcceptanceRule as is, or a rule named as in the module docstring (also a dict {"name": ..., "n"/"eps":
    ...}). Anything else is a ValueError that lists the names."""
    if isinstance(spec, AcceptanceRule):
        return spec
    if spec is None:
        return Exact()
    if isinstance(spec, dict) or hasattr(spec, "keys"):
        d = dict(spec)
        name = str(d.pop("name", d.pop("rule", ""))).lower()
        if name == "exact" and not d:
            return Exact()
        if name == "topk" and set(d) <= {"n"}:
            return TopK(int(d.get("n", 1)))
        if name == "distance" and set(d) <= {"eps"}:
            return Distance(float(d.get("eps", 0.0)))
        raise ValueError(f"unknown acceptance rule {spec!r}; use exact, topk (n) or distance (eps)")
    if isinstance(spec, str):
        s = spec.strip().lower()
        try:
            if s == "exact":
                return Exact()
            if s in ("topk", "distance"):
                return TopK(1) if s == "topk" else Distance(0.0)
            if m := _TOPK.match(s):
                return TopK(int(m.group(1)))
            if m := _DISTANCE.match(s):
                return Distance(float(m.group(1)))
        except ValueError as e:
            raise ValueError(f"bad acceptance rule {spec!r}: {e}") from e
    raise ValueError(f"unknown acceptance rule {spec!r}: use {NAMES}, or Exact(), TopK(n), Distance(eps)")
