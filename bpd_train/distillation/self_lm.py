"""Self-distillation for decoder-only models: the model answers the corpus prompts itself.

`respond_ids` decodes prompts (greedy, or sampled with a temperature, each row from a seed derived from its
record id so a shard re-decoded after a crash reproduces exactly) in length-sorted, token-budget batches, like
distillation/job.py `translate_ids` does for translation teachers. `distilled_record` turns a prompt record and
the model's response ids into the `{"prompt", "response"}` record that LMEncoder trains on; a prompt the model
answers with nothing (EOS at once) is reported, not written (an empty response has nothing to learn).
The sharded, resumable job around it (manifest, shards, workers) is job.py's.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch

from bpd_train.data.lm.processing import LMDataError, prompt_of


def row_seed(seed: int, record_id: str) -> int:
    """A 63-bit seed for one record: independent of batch composition, shard layout and worker."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "little") >> 1


def respond_ids(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_len: Any,
    max_sentences: int = 32,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    record_ids: Sequence[str] | None = None,
    progress=None,
    weights=None,
) -> list[list[int]]:
    """The model's responses (ids, EOS cut) to `prompts`, in their order. temperature 0: greedy. weights: a decoder's
    packed-weight cache (engine/weights.py PackedWeights: its decode options; None: fp32)."""
    from bpd_train.data.sampler import length_batches
    from bpd_train.decoding import greedy, parse_max_len
    from bpd_train.decoding.sampling import sample

    ml = parse_max_len(max_len, minimum=1)
    if record_ids is not None and len(record_ids) != len(prompts):
        raise ValueError(f"{len(record_ids)} record ids for {len(prompts)} prompts")
    ids = [str(i) for i in record_ids] if record_ids is not None else [str(i) for i in range(len(prompts))]
    out: list[list[int] | None] = [None] * len(prompts)
    for batch in length_batches([len(p) for p in prompts], max_sentences, max_tokens):
        rows = [list(prompts[i]) for i in batch]
        with torch.no_grad():
            if temperature > 0:
                r = sample(
                    model,
                    rows,
                    max_len=ml,
                    temperature=temperature,
                    row_seeds=[row_seed(seed, ids[i]) for i in batch],
                    weights=weights,
                )
            else:
                r = greedy(model, rows, max_len=ml, weights=weights)
        for row, i in enumerate(batch):
            out[i] = [int(t) for t in r.tokens[row]]
        if progress is not None:
            progress.update(len(batch))
    return out  # type: ignore[return-value]


def distilled_record(
    record: Mapping[str, Any],
    response_ids: Sequence[int],
    tok,
    *,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    where: str = "record",
) -> dict[str, Any] | None:
    """The record LMEncoder trains on, with the model's response: {"prompt", "response"} (translation pairs
    become their prompt text), or for a chat {"messages": the conversation + the model's assistant turn}.
    None when the response is empty (the caller counts and reports those: nothing to learn from them).
    The response is stored as text: re-encoding it may split it differently from the ids the model produced."""
    prompt, rendered = prompt_of(record, tok, src_lang, tgt_lang, where)
    text = tok.decode(response_ids)
    if not text.strip():
        return None
    if rendered:
        msgs = list(record["messages"])
        if msgs and msgs[-1].get("role") == "assistant":
            msgs = msgs[:-1]
        return {"messages": msgs + [{"role": "assistant", "content": text}]}
    return {"prompt": prompt, "response": text}


def prompt_ids(
    record: Mapping[str, Any], tok, *, src_lang: str | None = None, tgt_lang: str | None = None, where: str = "record"
) -> list[int]:
    """The ids the model is prompted with for a record (what LMEncoder puts before the response)."""
    prompt, rendered = prompt_of(record, tok, src_lang, tgt_lang, where)
    ids = tok.encode(prompt, add_special_tokens=not rendered)
    if not ids:
        raise LMDataError(f"{where}: the prompt encodes to no tokens")
    return ids
