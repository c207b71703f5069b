"""Exact blockwise decoding with bpd-train heads inside transformers' own `generate()` (its `custom_generate`
mechanism). bpd-train's `export.format=hf` of a decoder-only model writes this file as custom_generate/generate.py
beside config.json, model.safetensors and bpd_heads.safetensors; then

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64)

decodes with the heads: each forward pass checks the heads' last proposals against the model's own next tokens
and makes new ones, so the output is the model's greedy output (what `do_sample=False` gives) in fewer passes.
(`model.generate(..., custom_generate=folder, trust_remote_code=True)` does the same on a model loaded without it.)

Self-contained: torch, safetensors and transformers only (bpd-train need not be installed). Heads: bpd (the paper's
FFN heads) and medusa (residual SiLU blocks), as bpd_train/model/heads.py computes them. Rows are decoded one at a
time with a KV cache that is cut back to the accepted tokens after every pass. After a call, `model.bpd_stats`
holds {"passes": forward passes, "tokens": tokens generated} over the batch.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F

HEADS_FILE = "bpd_heads.safetensors"
HEADS_FORMAT = "bpd-train-heads"


def _heads_file(model: Any) -> str:
    where = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))
    path = os.path.join(where, HEADS_FILE)
    if os.path.isfile(path):
        return path
    from huggingface_hub import hf_hub_download  # a hub repo: the file beside its config.json

    return hf_hub_download(where, HEADS_FILE)


class Heads:
    """The k-1 proposing heads of a bpd-train export, read from bpd_heads.safetensors."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k).to(device=device, dtype=dtype) for k in f.keys()}
        if meta.get("format") != HEADS_FORMAT or "lm_config" not in meta:
            raise ValueError(f"{path} is not the heads file of a bpd-train decoder-only export")
        cfg = json.loads(meta["lm_config"])
        self.k = int(cfg["block_size"])
        self.kind = cfg.get("heads", "bpd")
        self.identity_p1 = bool(cfg.get("identity_p1", True))
        self.t = {k[len("heads."):]: v for k, v in tensors.items() if k.startswith("heads.")}
        if self.kind not in ("bpd", "medusa"):
            raise ValueError(f"{path}: heads of kind {self.kind!r}; this decoder knows bpd and medusa")

    def states(self, h: torch.Tensor, norm: Any) -> torch.Tensor:
        """h [D]: the last layer's output before the final norm -> [k-1, D], what the vocabulary projection reads
        for heads 2..k (the tokens 2..k positions ahead)."""
        d = h.shape[-1]
        if self.kind == "medusa":
            x = norm(h).unsqueeze(0).expand(self.k - 1, d)
            w, b = self.t["weight"], self.t["bias"]  # [k-1, layers, D, D], [k-1, layers, D]
            for layer in range(w.shape[1]):
                x = x + F.silu(torch.einsum("hi,hoi->ho", x, w[:, layer]) + b[:, layer])
            return x
        hidden = torch.relu(F.linear(h, self.t["fc1.weight"], self.t["fc1.bias"]))
        out = F.linear(hidden, self.t["fc2.weight"], self.t["fc2.bias"]).view(-1, d)
        first = 0 if self.identity_p1 else 1  # the output slice of head 2
        return norm(h.unsqueeze(0) + out[first:first + self.k - 1])


# generation options that change greedy decoding's choices, with the value that leaves them alone
_GREEDY_AS_IS: dict[str, Any] = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                                 "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
                                 "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None,
                                 "sequence_bias": None, "encoder_repetition_penalty": 1.0}


def _crop(cache: Any, keep: int) -> None:
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)  # a negative count removes that many tokens from the end


def _eos_ids(generation_config: Any, kwargs: dict) -> set[int]:
    eos = kwargs.get("eos_token_id", getattr(generation_config, "eos_token_id", None))
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


@torch.no_grad()
def generate(*args: Any, model: Any = None, input_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, generation_config: Any = None,
             max_new_tokens: int | None = None, **kwargs: Any) -> torch.Tensor:
    """Greedy output of `model` for each row of input_ids (left padding per attention_mask), decoded blockwise
    with the exported heads. Returns input_ids with the new tokens appended, finished rows padded with
    pad_token_id, as transformers' greedy `generate` does."""
    from transformers import DynamicCache

    if input_ids is None and args:
        input_ids = args[0]
    if model is None or input_ids is None:
        raise TypeError("generate() needs the model and input_ids")
    gc = generation_config if generation_config is not None else model.generation_config
    if kwargs.get("do_sample", getattr(gc, "do_sample", False)) or int(kwargs.get("num_beams", 1) or 1) != 1:
        raise ValueError("blockwise decoding with heads gives the greedy output: use do_sample=False, num_beams=1")
    changed = [k for k, plain in _GREEDY_AS_IS.items()
               if kwargs.get(k, getattr(gc, k, plain)) not in (plain, None) and kwargs.get(k, getattr(gc, k, plain))]
    if changed:  # options transformers applies to the logits: this decoder reads them as they are
        raise ValueError(f"blockwise decoding with heads runs plain greedy decoding; not supported: {changed}")
    if max_new_tokens is None:
        max_new_tokens = getattr(gc, "max_new_tokens", None)
    if max_new_tokens is None:
        max_new_tokens = max(int(getattr(gc, "max_length", 20) or 20) - input_ids.shape[1], 0)
    eos = _eos_ids(gc, kwargs)
    pad = kwargs.get("pad_token_id", getattr(gc, "pad_token_id", None))
    pad = pad if pad is not None else (min(eos) if eos else 0)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = decoder.norm
    w_out = model.get_output_embeddings().weight
    heads = Heads(_heads_file(model), w_out.device, w_out.dtype)
    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    seen: list[torch.Tensor] = []
    hook = norm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))  # the pre-norm state the heads read
    passes, rows = 0, []
    try:
        for r in range(input_ids.shape[0]):
            row = input_ids[r]
            keep = row if attention_mask is None else row[attention_mask[r].bool()]
            cache, feed, props, new = DynamicCache(), keep.tolist(), [], []
            done = max_new_tokens <= 0
            while not done:
                seen.clear()
                ids = torch.tensor([feed + props], device=input_ids.device)
                logits = model(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[0]
                passes += 1
                last = len(feed) - 1  # this pass's position of the last verified token
                nxt = logits[last:].argmax(-1).tolist()  # the model's own next token after each position
                a = 0
                while a < len(props) and nxt[a] == props[a]:
                    a += 1
                got = props[:a] + [nxt[a]]
                _crop(cache, cache.get_seq_length() - (len(props) - a))  # drop the rejected proposals
                for t in got:
                    new.append(t)
                    if t in eos or len(new) >= max_new_tokens:
                        done = True
                        break
                if not done:
                    feed = [got[-1]]
                    states = heads.states(seen[-1][0, last + a], norm)
                    props = F.linear(states, w_out).argmax(-1).tolist()
                    props = props[:max(max_new_tokens - len(new) - 1, 0)]
            rows.append(row.tolist() + new)
    finally:
        hook.remove()
    width = max(map(len, rows))
    model.bpd_stats = {"passes": passes, "tokens": sum(len(x) - input_ids.shape[1] for x in rows)}
    return torch.tensor([x + [pad] * (width - len(x)) for x in rows], dtype=input_ids.dtype, device=input_ids.device)
