"""Id lists in, decoded id lists out: beam search (greedy at beam 1) over length-sorted batches under a token budget.
The distillation teacher's decode and the evaluator's teacher comparison both run it."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from bpd_train.data.sampler import length_batches
from bpd_train.decoding.beam import beam_search
from bpd_train.decoding.greedy import greedy
from bpd_train.max_len import parse_max_len


def translate_ids(
    model,
    sources: Sequence[Sequence[int]],
    *,
    beam_size: int,
    length_penalty: float,
    max_len: Any,
    max_tokens: int,
    max_sentences: int,
    device=None,
    progress=None,
    amp_dtype=None,
) -> list[tuple[list[int], float | None]]:
    """Decode `sources` (ids + eos) with beam search (greedy when beam_size == 1), sorted by length and
    batched by token budget; returns (tokens, score) in the order of `sources`."""
    cfg = model.config
    device = device if device is not None else next(model.parameters()).device
    out: list[tuple[list[int], float | None] | None] = [None] * len(sources)
    ml = parse_max_len(max_len, minimum=1)
    for batch in length_batches([len(s) for s in sources], max_sentences, max_tokens):
        width = max(len(sources[i]) for i in batch)
        src = torch.full((len(batch), width), cfg.pad_id, dtype=torch.long)
        for row, i in enumerate(batch):
            src[row, : len(sources[i])] = torch.tensor(sources[i], dtype=torch.long)
        src = src.to(device)
        with (
            torch.no_grad(),
            torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype, enabled=amp_dtype is not None),
        ):
            if beam_size == 1:
                r = greedy(model, src, max_len=ml)
            else:
                r = beam_search(model, src, beam_size=beam_size, length_penalty=length_penalty, max_len=ml)
        scores = getattr(r, "scores", None)
        for row, i in enumerate(batch):
            s = None
            if scores is not None and scores[row] is not None:
                s = round(float(scores[row]), 4)
            out[i] = ([int(t) for t in r.tokens[row]], s)
        if progress is not None:
            progress.update(len(batch))
    return out  # type: ignore[return-value]
