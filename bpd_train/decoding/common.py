"""Input checks and bookkeeping shared by the decoders, and their max_len default (the type: bpd_train/max_len.py)."""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from bpd_train.engine.weights import PackedWeights, default_weights
from bpd_train.max_len import DEFAULT_MAX_LEN, MaxLen, max_len_json, parse_max_len  # noqa: F401 - the one max_len type


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (depth first, as model.parameters() orders them, without its
    generator and memo set: a measurable part of a batch-1 call), else of its first buffer, else the CPU."""
    stack = [model]
    while stack:
        mod = stack.pop()
        for p in mod._parameters.values():
            if p is not None:
                return p.device
        stack.extend(reversed([c for c in mod._modules.values() if c is not None]))
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def prepare_source(model: nn.Module, src) -> Tensor:
    """src: LongTensor [B,S] (ids + eos, right-padded) or a list of id lists -> LongTensor on the model's device."""
    return _source(model, src)[0]


def _source(model: nn.Module, src) -> tuple[Tensor, np.ndarray]:
    """(prepare_source's tensor, each row's non-padding token count [B] int64). Lists are laid out in numpy (through
    torch ops this bookkeeping was a measurable part of a batch-1 call)."""
    cfg = model.config
    if isinstance(src, Tensor):
        if src.dim() != 2:
            raise ValueError(f"src must be a [B,S] tensor, got shape {tuple(src.shape)}")
        t = src.to(device=model_device(model), dtype=torch.long)
        a = t.numpy() if t.device.type == "cpu" else t.cpu().numpy()
    else:
        rows = [list(map(int, r)) for r in src]
        if not rows:
            raise ValueError("empty batch: no source rows to decode")
        a = np.full((len(rows), max(max(len(r) for r in rows), 1)), cfg.pad_id, dtype=np.int64)
        for i, r in enumerate(rows):
            a[i, : len(r)] = r
        t = torch.from_numpy(a)
        dev = model_device(model)
        if dev.type != "cpu":
            t = t.to(dev)
    if a.shape[0] == 0:
        raise ValueError("empty batch: no source rows to decode")
    if a.shape[1] > cfg.max_positions:
        raise ValueError(f"source length {a.shape[1]} exceeds the model's max_positions={cfg.max_positions}")
    real = a != cfg.pad_id
    lens = real.sum(1)
    if a.shape[1] == 0 or not lens.all():
        raise ValueError("a source row is empty (only padding); sources must hold at least the eos token")
    return t, lens


def row_limits(model: nn.Module, src: Tensor, max_len, reserve: int = 0, lens=None) -> list[int]:
    """Per-row cap on generated tokens from a MaxLen, capped so that every decoder position stays below
    max_positions (`reserve` extra positions). lens: each row's non-padding tokens where the caller has them."""
    cap = model.config.max_positions - reserve
    m = parse_max_len(max_len)
    if isinstance(m, int):
        return [min(m, cap)] * src.shape[0]
    if lens is None:
        lens = (src != model.config.pad_id).sum(1).tolist()
    return [max(0, min(int(m[0] * n + m[1]), cap)) for n in lens]


@contextlib.contextmanager
def decoding_mode(model: nn.Module, weights: PackedWeights | None = None) -> Iterator:
    """Eval mode (no dropout) and no autograd for the duration; restores the caller's train/eval flag. Yields the
    step weights the decoder hands to the model (`model.encode(src, w)`, `model.start_decoding(..., weights=w)`):
    those of `weights` (a decoder's packed-weight cache: its DecodeOptions), else the model's default ones
    (engine/weights.py default_weights), checked against the model's parameters once for the duration: nothing
    trains while a decoder runs."""
    was_training = model.training
    if was_training:  # eval()/train() walk every submodule: skip them when there is nothing to switch
        model.eval()
    try:
        with torch.inference_mode():
            yield (weights if weights is not None else default_weights(model)).get(model)
    finally:
        if was_training:
            model.train()


def keep_rows(done: np.ndarray) -> np.ndarray:
    """The rows that go on decoding (done[r] False), in the order that moves the fewest cache rows: a row that
    stays within the new batch keeps its place, and each finished row's place is taken by a row from past the new
    end, so DecoderState.reorder copies one row per finished row (in order, every row after the first finished one
    moved: at batch 32 the copies were a sizeable share of greedy decoding's time). Rows are independent, so their order changes
    no output; decoders index their per-row bookkeeping with the same array."""
    keep = np.flatnonzero(~done)
    m = keep.size
    holes = np.flatnonzero(done[:m])  # places in the new batch whose row ended
    if holes.size:
        tail = keep[keep >= m]  # as many rows past the new end as there are holes
        keep = np.arange(m)
        keep[holes] = tail
    return keep


def start_tokens(model: nn.Module, state, rows: int, device) -> Tensor:
    """[R,1] every decoder's first input: BOS, unless the model says otherwise with `start_tokens(state)` (a
    decoder-only model starts from each prompt's last token, its prompt prefix already in the cache)."""
    hook = getattr(model, "start_tokens", None)
    if hook is not None:
        return hook(state)
    return torch.full((rows, 1), model.config.bos_id, dtype=torch.long, device=device)


# The ids that end a row, as every decoder tests them: the model's eos_id (an int), or an int64 array where a
# decoder-only checkpoint ends turns with several (LMConfig.eos_ids: Llama 3 / Qwen2 instruct list
# <|end_of_text|> and <|eot_id|>). One EOS stays a plain int compared with ==, so the encoder-decoder path (and its
# native loops, which take one id) costs and computes what it always did.
Stop = Union[int, np.ndarray]


def stop_ids(model: nn.Module) -> Stop:
    """The ids that end a row for this model (see Stop)."""
    ids = getattr(model.config, "eos_ids", None)
    return np.asarray(ids, dtype=np.int64) if ids else int(model.config.eos_id)


def is_stop(x, stop: Stop):
    """Elementwise: which of x (numpy array, tensor or int) are stop ids."""
    if isinstance(stop, int):
        return x == stop
    if isinstance(x, Tensor):
        return torch.isin(x, torch.from_numpy(stop).to(x.device))
    return np.isin(x, stop)


def trim(rows: list[list[int]], lengths: list[int], stop: Stop) -> list[list[int]]:
    """Cut each row to its produced length and drop a final EOS (any stop id)."""
    out = []
    for r, n in zip(rows, lengths):
        r = r[:n]
        if r and (r[-1] == stop if isinstance(stop, int) else r[-1] in stop):
            r = r[:-1]
        out.append(r)
    return out


class Rows(NamedTuple):
    """The per-row bookkeeping every decoder starts from (host-side numpy: one sync per step, no per-row loops)."""

    src: Tensor  # [R, S] the rows that may generate at all (limit > 0)
    orig: np.ndarray  # [R] original row of each of them
    limit: np.ndarray  # [R] token cap per row
    out: np.ndarray  # [B, cap + spare] output buffer, pad-filled, for every original row
    out_len: np.ndarray  # [B] tokens written so far
    cap: int  # the largest limit (>= 1)


def start_rows(model: nn.Module, src, max_len, spare: int = 0) -> Rows:
    src, lens = _source(model, src)
    limits = np.asarray(row_limits(model, src, max_len, lens=lens.tolist()), dtype=np.int64)
    b = src.shape[0]
    cap = max(int(limits.max()), 1)
    orig = np.flatnonzero(limits > 0)
    if 0 < orig.size < b:
        src = src[torch.from_numpy(orig).to(src.device)]
    return Rows(
        src,
        orig,
        limits[orig],
        np.full((b, cap + spare), model.config.pad_id, dtype=np.int64),
        np.zeros(b, dtype=np.int64),
        cap,
    )
