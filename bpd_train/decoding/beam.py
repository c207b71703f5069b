"""Beam search, fairseq-style: flat (batch x beam) rows, 2*beam candidates per step so hypotheses that end
with EOS never starve the beam, GNMT length penalty, per-sentence early finish, KV cache reordered by
beam origin, finished sentences dropped from the batch.

The step policy (which candidates to consider) is separate from the loop (bookkeeping, finalisation,
cache reordering), as in fairseq's `search.BeamSearch` vs `SequenceGenerator`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from bpd_train.decoding.common import (
    DEFAULT_MAX_LEN,
    decoding_mode,
    is_stop,
    prepare_source,
    row_limits,
    start_tokens,
    stop_ids,
)
from bpd_train.decoding.result import DecodeResult
from bpd_train.engine.weights import PackedWeights


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016): ((5 + |Y|) / 6) ** alpha, |Y| counting the EOS token."""
    return ((5.0 + length) / 6.0) ** alpha


class BeamSearchPolicy:
    """Plain beam search step: the top `n_cand` (beam origin, token) continuations by total log-prob."""

    def step(self, step: int, lprobs: Tensor, scores: Tensor, n_cand: int) -> tuple[Tensor, Tensor, Tensor]:
        """lprobs [b,K,V] next-token log-probs, scores [b,K] running sums -> (cand_scores, cand_beams,
        cand_tokens), each [b,n_cand], best first. At step 0 all beams are the same (BOS): only beam 0 counts."""
        b, beam, v = lprobs.shape
        if step == 0:
            lprobs = lprobs[:, :1]
        else:
            lprobs = lprobs + scores.unsqueeze(-1)
        flat = lprobs.reshape(b, -1)
        top_s, top_i = flat.topk(min(n_cand, flat.shape[1]), dim=1)
        if top_s.shape[1] < n_cand:  # tiny vocabularies: pad with impossible candidates
            pad = n_cand - top_s.shape[1]
            top_s = torch.cat([top_s, top_s.new_full((b, pad), -math.inf)], 1)
            top_i = torch.cat([top_i, top_i.new_zeros((b, pad))], 1)
        return top_s, top_i // v, top_i % v


def beam_search(
    model,
    src,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len=DEFAULT_MAX_LEN,
    policy: BeamSearchPolicy | None = None,
    weights: PackedWeights | None = None,
) -> DecodeResult:
    """Best hypothesis per source by length-normalised log-probability. `scores` holds those scores.

    A sentence finishes when `beam_size` hypotheses have ended (fairseq's criterion) or when it reaches
    its max_len, where EOS is forced. Sentences that finish leave the batch."""
    cfg = model.config
    if int(beam_size) < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    beam = int(beam_size)
    alpha = float(length_penalty)
    policy = policy or BeamSearchPolicy()
    eos, stop = cfg.eos_id, stop_ids(model)  # a forced end writes eos_id; any stop id ends a hypothesis
    with decoding_mode(model, weights) as w:
        src = prepare_source(model, src)
        limits = row_limits(model, src, max_len, reserve=1)  # the forced EOS needs one more position
        b, dev = src.shape[0], src.device
        cap = max(limits) + 1
        state = model.start_decoding(model.encode(src, w), cap, expand=beam, weights=w)
        hyp = torch.full((b * beam, cap), cfg.pad_id, dtype=torch.long, device=dev)  # tokens so far per row
        scores = torch.zeros(b, beam, device=dev)
        sent = list(range(b))  # original sentence of each active sentence
        limit = torch.tensor(limits, device=dev)
        finalized: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
        n_cand = 2 * beam
        cand_rank = torch.arange(n_cand, device=dev)
        tok = start_tokens(model, state, b * beam, dev)  # [b*K,1] BOS (an LM: last prompt tokens)
        calls = sent_steps = 0
        for step in range(cap):
            nb = len(sent)
            h = model.decode(state, tok)  # [nb*K,1,D]
            state.lengths += 1
            if step:
                calls += 1
                sent_steps += nb
            lprobs = F.log_softmax(state.weights.head1(h[:, 0]).float(), dim=-1)  # [nb*K,V]
            v = lprobs.shape[-1]
            lprobs = lprobs.view(nb, beam, v)
            forced = limit <= step  # [nb] max_len reached: EOS only
            if bool(forced.any()):
                only_eos = torch.full((v,), -math.inf, device=dev)
                only_eos[eos] = 0.0
                lprobs = torch.where(forced[:, None, None], lprobs + only_eos, lprobs)
            cand_scores, cand_beams, cand_tokens = policy.step(step, lprobs, scores, n_cand)  # [nb,2K]
            is_eos = is_stop(cand_tokens, stop) & torch.isfinite(cand_scores)
            fin = is_eos[:, :beam]  # only the top K may end
            finished_sent = [False] * nb
            if bool(fin.any()):
                lp = gnmt_length_penalty(step + 1, alpha)
                ii, jj = fin.nonzero(as_tuple=True)
                sc = cand_scores[ii, jj].tolist()
                # only the ending hypotheses' tokens go to Python (one device->host copy of a few rows)
                toks = hyp.index_select(0, ii * beam + cand_beams[ii, jj])[:, :step].tolist() if step else None
                for n, (i, s) in enumerate(zip(ii.tolist(), sc)):
                    f = finalized[sent[i]]
                    if len(f) < beam:
                        f.append((s / lp, toks[n] if toks is not None else []))
                    if len(f) >= beam:
                        finished_sent[i] = True
            for i, fz in enumerate(forced.tolist()):
                if fz:
                    finished_sent[i] = True
            # next beams: the first K candidates that did not end
            key = cand_rank + is_eos.long() * n_cand
            pick = key.topk(beam, dim=1, largest=False).indices  # [nb,K]
            new_scores = cand_scores.gather(1, pick)
            new_beams = cand_beams.gather(1, pick)
            new_tokens = cand_tokens.gather(1, pick)
            keep = [i for i in range(nb) if not finished_sent[i]]
            if not keep:
                break
            if len(keep) < nb:
                kidx = torch.tensor(keep, device=dev)
                new_scores, new_beams, new_tokens = new_scores[kidx], new_beams[kidx], new_tokens[kidx]
                limit = limit[kidx]
                sent = [sent[i] for i in keep]
                base = kidx
            else:
                base = torch.arange(nb, device=dev)
            rows = (base[:, None] * beam + new_beams).view(-1)  # beam origin of each new row
            state.reorder(rows)
            hyp = hyp.index_select(0, rows)
            hyp[:, step] = new_tokens.view(-1)
            scores = new_scores
            tok = new_tokens.view(-1, 1)
    tokens, best_scores = [], []
    for f in finalized:
        s, t = max(f, key=lambda e: e[0]) if f else (-math.inf, [])
        tokens.append(t)
        best_scores.append(s)
    return DecodeResult(
        tokens=tokens,
        calls=calls,
        prefill_calls=1,
        mean_accepted=1.0,
        accepted_hist={1: sent_steps} if sent_steps else {},
        scores=best_scores,
    )
