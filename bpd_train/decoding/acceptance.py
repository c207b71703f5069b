"""Acceptance rules for blockwise decoding: which proposals head 1 (p1) verifies.

Each rule maps proposals [R,m], head-1 logits at the positions that predict them [R,m,V] and head-1's
argmax there [R,m] to a bool [R,m]. Blockwise accepts the longest all-True prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


class AcceptanceRule:
    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class Exact(AcceptanceRule):
    """Accept a proposal iff it is head 1's argmax: the output is exactly greedy decoding's."""

    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:
        return proposals == argmax


@dataclass(frozen=True)
class TopK(AcceptanceRule):
    """Accept a proposal iff it lies in head 1's top-n (fewer than n tokens score strictly higher)."""

    n: int = 1

    def __post_init__(self) -> None:
        if int(self.n) < 1:
            raise ValueError(f"TopK needs n >= 1, got {self.n}")

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

    def __call__(self, proposals: Tensor, logits: Tensor, argmax: Tensor) -> Tensor:
        return (proposals - argmax).abs() <= self.eps


def make_acceptance(spec) -> AcceptanceRule:
    """An AcceptanceRule as is, or a name from config: "exact", "topk:N", "distance:EPS" (also a dict
    {"name": ..., "n"/"eps": ...}). Anything else is a ValueError."""
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
        name, _, arg = spec.strip().lower().partition(":")
        try:
            if name == "exact" and not arg:
                return Exact()
            if name == "topk":
                return TopK(int(arg) if arg else 1)
            if name == "distance":
                return Distance(float(arg) if arg else 0.0)
        except ValueError as e:
            raise ValueError(f"bad acceptance rule {spec!r}: {e}") from e
    raise ValueError(f"unknown acceptance rule {spec!r}; use Exact(), TopK(n), Distance(eps) "
                     f"or one of 'exact', 'topk:N', 'distance:EPS'")
