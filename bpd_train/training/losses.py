"""BPD training losses and teacher-forced head metrics.

Head i (0-based; 0 = the original p1) at decoder position t predicts target position t+i, i.e. tgt_out[:, t+i].
The k×T×V logits are never materialised at once: `mean`/`weighted` run the heads one after another and, with
`recompute`, wrap each head in torch.utils.checkpoint so that backward recomputes that head's logits instead of
keeping all k of them alive -- peak memory stays near one head's, as for `random`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bpd_train.configs import HEAD_LOSSES  # noqa: F401 - declared with the regime's other choices


def head_targets(tgt_out: torch.Tensor, i: int, pad_id: int) -> torch.Tensor:
    """[B,T] targets of head i: tgt_out shifted left by i, the last i positions padded (ignored)."""
    if i == 0:
        return tgt_out
    out = torch.full_like(tgt_out, pad_id)
    if i < tgt_out.size(1):
        out[:, :-i] = tgt_out[:, i:]
    return out


def head_weights(
    head_loss: str,
    heads: Sequence[int],
    weights: Sequence[float] | None = None,
    decay: float = 0.8,
    p1_weight: float | None = None,
) -> list[float]:
    """Normalised weights for the heads that enter the loss this step (they sum to 1).

    p1_weight: head 1's share whenever it enters the loss together with other heads; they share the rest in the
    proportions head_loss gives them. With a trainable backbone, head 1 is the model's own next-token prediction,
    the output that exact decoding returns: a 1/k share lets the future heads pull the backbone away from it."""
    if head_loss == "weighted":
        if weights is not None:
            raw = [float(weights[i]) for i in heads]
        else:
            raw = [float(decay) ** i for i in heads]
    else:
        raw = [1.0] * len(heads)
    total = sum(raw)
    if total <= 0:
        raise ValueError(f"head weights must sum to a positive number, got {raw}")
    if p1_weight is None or len(heads) < 2 or 0 not in heads:
        return [w / total for w in raw]
    p1 = check_p1_weight(p1_weight)
    i0 = list(heads).index(0)
    rest = total - raw[i0]
    if rest <= 0:
        raise ValueError(f"head weights of heads 2..k must sum to a positive number, got {raw}")
    return [p1 if j == i0 else (1.0 - p1) * w / rest for j, w in enumerate(raw)]


def check_p1_weight(p1_weight: float) -> float:
    p1 = float(p1_weight)
    if not 0.0 < p1 < 1.0:
        raise ValueError(f"loss.p1_weight must be in (0, 1) (head 1's share of the loss) or null, got {p1_weight}")
    return p1


def smoothed_ce_sum(logits: torch.Tensor, targets: torch.Tensor, pad_id: int, label_smoothing: float) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-pad targets (fp32 whatever the logits' dtype)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=label_smoothing,
        reduction="sum",
    )


def check_kd(kd_weight: float, kd_temperature: float) -> tuple[float, float]:
    lam, t = float(kd_weight), float(kd_temperature)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"loss.kd_weight must be in [0, 1] (the KL term's share of head 1's loss), got {kd_weight}")
    if not t > 0.0:
        raise ValueError(f"loss.kd_temperature must be > 0, got {kd_temperature}")
    return lam, t


def kd_settings(loss_cfg) -> tuple[float, float]:
    """(kd_weight, kd_temperature) of a loss config, checked; absent or null: off, temperature 1."""
    w, t = loss_cfg.get("kd_weight"), loss_cfg.get("kd_temperature")
    return check_kd(0.0 if w is None else w, 1.0 if t is None else t)


def kd_kl_sum(
    logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, pad_id: int, temperature: float = 1.0
) -> torch.Tensor:
    """Summed KL(p_teacher || p_student) over the non-pad target positions, both at `temperature`, times T²
    (Hinton et al. 2015: the gradient's scale stays that of T = 1). Word-level distillation (Kim & Rush 2016)."""
    keep = targets.ne(pad_id)
    t = float(temperature)
    s = F.log_softmax(logits[keep].float() / t, dim=-1)  # [N,V]
    p = F.log_softmax(teacher_logits[keep].float() / t, dim=-1)  # [N,V]
    return F.kl_div(s, p, reduction="sum", log_target=True) * (t * t)


def bpd_loss(
    head_logits: Callable[[torch.Tensor, int], torch.Tensor],
    h: torch.Tensor,
    tgt_out: torch.Tensor,
    heads: Sequence[int],
    weights: Sequence[float],
    pad_id: int,
    label_smoothing: float = 0.0,
    recompute: bool = True,
    teacher_logits: torch.Tensor | None = None,
    kd_weight: float = 0.0,
    kd_temperature: float = 1.0,
    extras: dict[str, torch.Tensor] | None = None,
    self_targets: bool = False,
    self_kd_weight: float = 0.0,
    chain: bool = False,
    prev_series: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Weighted sum over `heads` of each head's token-mean label-smoothed CE.

    head_logits(h, i) -> [B,T,V] (BPDModel.head_logits); h [B,T,D] is the decoder output.
    teacher_logits [B,T,V] with kd_weight = λ > 0: head 1's loss is (1-λ)·CE + λ·KL(p_teacher || p_head1), both
    token means (check_kd); λ = 0 is the plain CE, computed exactly as without a teacher.
    self_targets: heads 2..k learn head 1's own (teacher-forced) argmax at the position they look ahead to instead of
    the data's token there (exact decoding accepts a proposal when it equals head 1's choice); head 1 keeps the data.
    self_kd_weight = μ > 0: heads 2..k's loss is (1-μ)·CE + μ·KL(p_head1 at t+i ‖ p_head_i at t): each future head
    also learns the model's own (teacher-forced, detached) head-1 distribution at the position it looks ahead to,
    the soft labels of Medusa-2's self-distillation (on a model's own greedy output the CE target is that
    distribution's argmax).
    chain: chained heads (model/heads.py ChainHeads): head_logits(h, i, prev) also takes the token before head i's
    target, teacher-forced: the same series head i learns, shifted by i-1 (head 1's own choices under self_targets),
    or prev_series [B,T] where given (the targets before a draft vocabulary's mask).
    Returns (loss, {head: detached per-head loss}); `extras`, if given, receives the detached token-mean "kd".
    """
    total = h.new_zeros((), dtype=torch.float32)
    per_head: dict[int, torch.Tensor] = {}
    use_ckpt = recompute and len(heads) > 1 and torch.is_grad_enabled()
    lam, temp = check_kd(kd_weight, kd_temperature)
    if lam > 0 and teacher_logits is None:
        raise ValueError("kd_weight > 0 needs teacher_logits")
    mu = float(self_kd_weight)
    if not 0.0 <= mu <= 1.0:
        raise ValueError(f"loss.self_kd_weight must be in [0, 1] (the KL term's share of heads 2..k's loss), got {mu}")
    own = own_logits = None
    if (self_targets or mu > 0) and any(i > 0 for i in heads):
        with torch.no_grad():  # [B,T,V] head 1, teacher-forced
            own_logits = head_logits(h.detach(), 0)
        if self_targets:  # [B,T] head 1's choices, pads kept
            own = own_logits.argmax(-1).masked_fill(tgt_out.eq(pad_id), pad_id)
        if mu == 0:
            own_logits = None
    for i, w in zip(heads, weights):
        series = own if own is not None and i > 0 else tgt_out
        tgt = head_targets(series, i, pad_id)
        prev = head_targets(series if prev_series is None else prev_series, i - 1, pad_id) if chain and i > 0 else None
        n = tgt.ne(pad_id).sum().clamp_min(1)
        kd = (i == 0 and lam > 0) or (i > 0 and own_logits is not None)
        if i > 0 and own_logits is not None:  # head 1 at t+i, aligned with head i at t
            soft = torch.zeros_like(own_logits)
            if i < soft.size(1):
                soft[:, :-i] = own_logits[:, i:]
            share, t_kd = mu, 1.0
        else:
            soft, share, t_kd = teacher_logits, lam, temp

        def one_head(h_: torch.Tensor, i=i, tgt=tgt, kd=kd, soft=soft, t_kd=t_kd, prev=prev) -> torch.Tensor:
            logits = head_logits(h_, i) if prev is None else head_logits(h_, i, prev)
            ce = smoothed_ce_sum(logits, tgt, pad_id, label_smoothing)
            if not kd:
                return ce
            return torch.stack([ce, kd_kl_sum(logits, soft, tgt, pad_id, t_kd)])

        s = checkpoint(one_head, h, use_reentrant=False) if use_ckpt else one_head(h)
        if kd:
            if extras is not None and i == 0:
                extras["kd"] = (s[1] / n).detach()
            s = (1.0 - share) * s[0] + share * s[1]
        li = s / n
        per_head[i] = li.detach()
        total = total + w * li
    return total, per_head


@torch.no_grad()
def head_stats(
    head_logits: Callable[[torch.Tensor, int], torch.Tensor],
    h: torch.Tensor,
    tgt_out: torch.Tensor,
    k: int,
    pad_id: int,
    label_smoothing: float = 0.0,
    chain: bool = False,
) -> dict[str, torch.Tensor]:
    """Teacher-forced sums for validation, reducible across ranks by addition.

    loss_sum[i], count[i], correct[i]: head i's summed loss, its non-pad targets, its top-1 hits.
    accepted_sum / positions: at every non-pad position, the number of consecutive heads from head 1 that are
    right (0..k), summed -- divided, a teacher-forced estimate of the mean accepted block size k̂.
    chain: chained heads, each given the target before its own (it counts only where heads 1..i-1 were right, so
    this is the token decoding gives it there).
    """
    loss_sum = torch.zeros(k, dtype=torch.float64, device=h.device)
    count = torch.zeros(k, dtype=torch.float64, device=h.device)
    correct = torch.zeros(k, dtype=torch.float64, device=h.device)
    run = torch.ones_like(tgt_out, dtype=torch.bool)  # heads 0..i-1 all right so far
    accepted = torch.zeros_like(tgt_out, dtype=torch.float64)
    for i in range(k):
        tgt = head_targets(tgt_out, i, pad_id)
        valid = tgt.ne(pad_id)
        logits = head_logits(h, i, head_targets(tgt_out, i - 1, pad_id)) if chain and i > 0 else head_logits(h, i)
        loss_sum[i] = smoothed_ce_sum(logits, tgt, pad_id, label_smoothing).double()
        hit = (logits.argmax(-1) == tgt) & valid
        count[i] = valid.sum()
        correct[i] = hit.sum()
        run = run & hit
        accepted += run
    positions = tgt_out.ne(pad_id)
    return {
        "loss_sum": loss_sum,
        "count": count,
        "correct": correct,
        "accepted_sum": accepted[positions].sum().reshape(1),
        "positions": positions.sum().double().reshape(1),
    }
