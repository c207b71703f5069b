"""Exact blockwise decoding with bpd-train heads inside transformers' own `generate()` (its `custom_generate`
mechanism). bpd-train's `export.format=hf` writes this file as custom_generate/generate.py beside config.json,
model.safetensors and bpd_heads.safetensors, for both model families (decoder-only Llama / Qwen2 folders and
encoder-decoder Marian / Pegasus / M2M100 translation folders); then

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)   # or MarianMTModel, ...
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64)

decodes with the heads: each forward pass checks the heads' last proposals against the model's own next tokens
and makes new ones, so the output is the model's greedy output (what `do_sample=False` gives) in fewer passes.
With `do_sample=True` (and transformers' temperature, top_k, top_p) it samples blockwise: the heads draft from their
own adjusted distributions q, each draft is accepted with probability min(1, p/q) against the model's p, the first
rejection draws from max(0, p - q) normalised, a fully accepted block draws one more token from p -- so the answers
are distributed as transformers' own sampling gives them (not the same tokens for the same torch seed). Draws use
torch's global generator (`torch.manual_seed` reproduces a call), as transformers' sampling does.
(`model.generate(..., custom_generate=folder, trust_remote_code=True)` does the same on a model loaded without it.)

Self-contained: torch, safetensors and transformers only (bpd-train need not be installed). Heads: bpd (the paper's
FFN heads) and medusa (residual SiLU blocks), as bpd_train/model/heads.py computes them. Rows are decoded one at a
time with a KV cache that is cut back to the accepted tokens after every pass. After a call, `model.bpd_stats`
holds {"passes": decoder forward passes, "tokens": tokens generated} over the batch.
"""

from __future__ import annotations

import inspect
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
    """The k-1 proposing heads of a bpd-train export, read from bpd_heads.safetensors (metadata lm_config for a
    decoder-only model, bpd_config for a translation model; both hold block_size and identity_p1)."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k).to(device=device, dtype=dtype) for k in f.keys()}
        key = "lm_config" if "lm_config" in meta else "bpd_config"
        if meta.get("format") != HEADS_FORMAT or key not in meta:
            raise ValueError(f"{path} is not the heads file of a bpd-train export")
        cfg = json.loads(meta[key])
        if cfg.get("head_chain"):
            raise ValueError(f"{path}: chained heads are not supported here")
        self.k = int(cfg["block_size"])
        self.kind = cfg.get("heads", "bpd")
        self.identity_p1 = bool(cfg.get("identity_p1", True))
        self.t = {k[len("heads.") :]: v for k, v in tensors.items() if k.startswith("heads.")}
        if self.kind not in ("bpd", "medusa"):
            raise ValueError(f"{path}: heads of kind {self.kind!r}; this decoder knows bpd and medusa")
        if self.k > 1 and not self.t:
            raise ValueError(f"{path} says block_size {self.k} but holds no heads")

    def states(self, h: torch.Tensor, norm: Any) -> torch.Tensor:
        """h [D]: the last decoder layer's output before the final norm (if any) -> [k-1, D], what the vocabulary
        projection reads for heads 2..k (the tokens 2..k positions ahead)."""
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
        return norm(h.unsqueeze(0) + out[first : first + self.k - 1])


# generation options that change greedy decoding's choices, with the value that leaves them alone
_GREEDY_AS_IS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_eos_token_id": None,
    "min_length": 0,
    "min_new_tokens": None,
    "sequence_bias": None,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "guidance_scale": 1.0,
    "exponential_decay_length_penalty": None,
    "watermarking_config": None,
    "stop_strings": None,
    "token_healing": False,
}
# sampling options other than temperature, top_k and top_p, with the value that leaves them alone
_SAMPLE_AS_IS: dict[str, Any] = {"typical_p": 1.0, "min_p": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
# what this function does not return or does not do: asked for, it is refused rather than silently left out
_NOT_HERE = (
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
    "streamer",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "decoder_input_ids",
    "inputs_embeds",
    "negative_prompt_ids",
)


def _crop(cache: Any, keep: int) -> None:
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)  # a negative count removes that many tokens from the end


def _eos_ids(generation_config: Any, kwargs: dict) -> set[int]:
    eos = kwargs.get("eos_token_id", getattr(generation_config, "eos_token_id", None))
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _option(name: str, gc: Any, kwargs: dict, plain: Any = None) -> Any:
    return kwargs.get(name, getattr(gc, name, plain))


def _given(value: Any) -> bool:
    """An option set to something (None, False and an empty list are its unset values)."""
    return value is not None and value is not False and not (isinstance(value, (list, tuple)) and not value)


def _banned(gc: Any, kwargs: dict) -> list[int]:
    """bad_words_ids of single tokens (opus-mt bans its pad so): never generated, as transformers' greedy does."""
    words = _option("bad_words_ids", gc, kwargs) or []
    if any(len(w) != 1 for w in words):
        raise ValueError("blockwise decoding with heads supports bad_words_ids of single tokens only")
    return sorted({int(w[0]) for w in words})


class Sampling:
    """transformers' sampling distribution, as its logits processors make it: logits / temperature, then the top_k
    highest (ties with the k-th kept), then the smallest most likely set whose probability reaches top_p."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        if not temperature > 0:
            raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.t, self.top_k, self.top_p = float(temperature), int(top_k or 0), float(top_p)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probabilities [..., V] (float64)."""
        x = logits.double() / self.t
        if 0 < self.top_k < x.shape[-1]:
            x = x.masked_fill(x < x.topk(self.top_k, dim=-1).values[..., -1:], float("-inf"))
        if self.top_p < 1.0:
            sp, order = torch.softmax(x, -1).sort(dim=-1, descending=True, stable=True)
            drop = (sp.cumsum(-1) - sp) >= self.top_p  # the mass ranked above already reaches top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
        return torch.softmax(x, -1)


def _draw(p: torch.Tensor) -> int:
    return int(torch.multinomial(p.float() / p.sum(), 1))


def _state_hook(decoder: Any, seen: list) -> Any:
    """Record the last decoder layer's output: the state (before the final norm, if any) the heads read."""

    def hook(_m: Any, _a: Any, out: Any) -> None:
        seen.append(out[0] if isinstance(out, (tuple, list)) else out)

    return decoder.layers[-1].register_forward_hook(hook)


@torch.no_grad()
def generate(
    *args: Any,
    model: Any = None,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    generation_config: Any = None,
    max_new_tokens: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Greedy output of `model` (do_sample=True: a sample of its distribution) for each row of input_ids, decoded
    blockwise with the exported heads. Decoder-only:
    input_ids are prompts (left padding per attention_mask), returned with the new tokens appended. Encoder-decoder:
    input_ids are sources (padding per attention_mask), and the result is each row's decoder output from the
    decoder start token on. Finished rows are padded with pad_token_id, as transformers' greedy `generate` does."""
    from transformers import DynamicCache

    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    if input_ids is None and args:
        input_ids = args[0]
    if model is None or input_ids is None:
        raise TypeError("generate() needs the model and input_ids")
    gc = generation_config if generation_config is not None else model.generation_config
    if int(_option("num_beams", gc, kwargs, 1) or 1) != 1:
        raise ValueError(
            "blockwise decoding with heads gives the greedy output (do_sample=False) or samples (do_sample=True); "
            "use num_beams=1"
        )
    sampler = None
    if _option("do_sample", gc, kwargs, False):
        sampler = Sampling(
            _option("temperature", gc, kwargs, 1.0) or 1.0,
            _option("top_k", gc, kwargs, 50),
            _option("top_p", gc, kwargs, 1.0) if _option("top_p", gc, kwargs, 1.0) is not None else 1.0,
        )
    encdec = bool(getattr(model.config, "is_encoder_decoder", False))
    as_is = dict(_GREEDY_AS_IS, **({} if encdec else {"forced_bos_token_id": None}))
    if sampler is not None:
        as_is.update(_SAMPLE_AS_IS)
    changed = [
        k
        for k, plain in as_is.items()
        if _option(k, gc, kwargs, plain) not in (plain, None) and _option(k, gc, kwargs, plain)
    ]
    changed += [k for k in _NOT_HERE if _given(_option(k, gc, kwargs))]
    if int(_option("num_return_sequences", gc, kwargs, 1) or 1) != 1:
        changed.append("num_return_sequences")
    if changed:  # options transformers applies to the logits: this decoder reads them as they are
        raise ValueError(f"blockwise decoding with heads runs plain greedy decoding; not supported: {changed}")
    banned = _banned(gc, kwargs)
    if max_new_tokens is None and "max_length" not in kwargs:
        max_new_tokens = getattr(gc, "max_new_tokens", None)
    if max_new_tokens is None:  # max_length counts the prompt, or the decoder start token
        max_length = int(_option("max_length", gc, kwargs, 20) or 20)
        max_new_tokens = max(max_length - (1 if encdec else input_ids.shape[1]), 0)
    eos = _eos_ids(gc, kwargs)
    pad = _option("pad_token_id", gc, kwargs)
    pad = pad if pad is not None else (min(eos) if eos else 0)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if encdec and hasattr(decoder, "decoder"):  # a base model's get_decoder may give the seq2seq model itself
        decoder = decoder.decoder
    norm = getattr(decoder, "norm", None)
    norm = norm if norm is not None else getattr(decoder, "layer_norm", None)
    norm = norm if norm is not None else (lambda x: x)  # Marian: no final norm
    w_out = model.get_output_embeddings().weight
    bias = torch.zeros(w_out.shape[0], device=w_out.device, dtype=w_out.dtype)
    if getattr(model, "final_logits_bias", None) is not None:  # Marian, Pegasus
        bias = bias + model.final_logits_bias.reshape(-1)[: bias.shape[0]]
    bias[banned] = float("-inf")
    heads = Heads(_heads_file(model), w_out.device, w_out.dtype)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    dev = input_ids.device

    if encdec:
        from transformers import EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        start = _option("decoder_start_token_id", gc, kwargs)
        start = start if start is not None else model.config.decoder_start_token_id
        forced = _option("forced_bos_token_id", gc, kwargs)
        memory = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    seen: list[torch.Tensor] = []
    hook = _state_hook(decoder, seen)
    passes, rows = 0, []
    try:
        for r in range(input_ids.shape[0]):
            row = input_ids[r]
            if encdec:
                prefix = [int(start)]
                new = [int(forced)] if forced is not None and max_new_tokens > 0 else []
                cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
                extra = {
                    "encoder_outputs": BaseModelOutput(last_hidden_state=memory[r : r + 1]),
                    "attention_mask": None if attention_mask is None else attention_mask[r : r + 1],
                }
                ids_kw = "decoder_input_ids"
            else:
                prefix = (row if attention_mask is None else row[attention_mask[r].bool()]).tolist()
                new, cache, extra, ids_kw = [], DynamicCache(), {}, "input_ids"
            feed, props, qs = prefix + new, [], None
            done = len(new) >= max_new_tokens or bool(new and new[-1] in eos)
            while not done:
                seen.clear()
                ids = torch.tensor([feed + props], device=dev)
                logits = model(**{ids_kw: ids, cache_kw: cache}, use_cache=True, **extra).logits[0]
                passes += 1
                last = len(feed) - 1  # this pass's position of the last verified token
                if banned:
                    logits = logits.clone()
                    logits[:, banned] = float("-inf")
                if sampler is None:
                    nxt = logits[last:].argmax(-1).tolist()  # the model's own next token after each position
                    a = 0
                    while a < len(props) and nxt[a] == props[a]:
                        a += 1
                    got = props[:a] + [nxt[a]]
                else:  # accept draft a with probability min(1, p/q); then the residual, or after a full block p
                    ps = sampler.probs(logits[last:])
                    a = 0
                    while a < len(props) and float(torch.rand(())) * qs[a, props[a]] < ps[a, props[a]]:
                        a += 1
                    rest = (ps[a] - qs[a]).clamp(min=0.0) if a < len(props) else ps[a]
                    got = props[:a] + [_draw(rest if float(rest.sum()) > 0 else ps[a])]
                _crop(cache, cache.get_seq_length() - (len(props) - a))  # drop the rejected proposals
                for t in got:
                    new.append(t)
                    if t in eos or len(new) >= max_new_tokens:
                        done = True
                        break
                if not done:
                    feed = [got[-1]]
                    room = max(max_new_tokens - len(new) - 1, 0)
                    if heads.k > 1 and room:
                        states = heads.states(seen[-1][0, last + a], norm)
                        head_logits = (F.linear(states, w_out) + bias)[:room]
                        if sampler is None:
                            props = head_logits.argmax(-1).tolist()
                        else:  # each head drafts from its own adjusted distribution
                            qs = sampler.probs(head_logits)
                            props = [_draw(q) for q in qs]
                    else:
                        props = []
            rows.append((row.tolist() if not encdec else prefix) + new)
    finally:
        hook.remove()
    width = max(map(len, rows))
    lead = 1 if encdec else input_ids.shape[1]
    model.bpd_stats = {"passes": passes, "tokens": sum(len(x) - lead for x in rows)}
    return torch.tensor([x + [pad] * (width - len(x)) for x in rows], dtype=input_ids.dtype, device=dev)
