"""`DecodeStep`: what every decoder (greedy, beam search, blockwise, sampling) calls per step, whatever the model
family. Each family implements it once, apart from its model definition: engine/mt.py `DecodeWeights`
(encoder-decoder BPDModel), engine/lm.py `LMDecodeWeights` (decoder-only LMModel). A decoder's packed-weight
cache (engine/weights.py PackedWeights) builds them for its DecodeOptions and keeps them until a weight changes.

The native-loop members (greedy_steps, block_steps, batch_block_steps, multi_stop, last_seconds, stats) are what a
decoder uses where present; a step without them (a test's scripted weights, say) decodes through the Python steps.
h below is the decoder output [..., D] before the final norm. Exactness rests on these methods: a row's outputs
are bit-identical whatever the number of rows or block positions computed with it, so exact blockwise decoding
returns greedy decoding's tokens of the same precision (docs/engine.md)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor


@runtime_checkable
class DecodeStep(Protocol):
    options: Any  # engine/packed.py DecodeOptions: dtype, draft_vocab, proposal_dtype
    vocab_size: int
    draft_ids: Tensor | None  # the ids heads 2..k propose among (None: the full vocabulary)
    stats: dict  # decoders' statistics kept with these weights (adaptive feeding's)
    last_seconds: float | None  # time of the last native loop call (what adaptive feeding compares)
    native_loop: Any  # None where the native loops do not run (CUDA, torch engine, own head 1)
    verify_group: int | None  # head-1 positions per pass in the loops' lazy verification, batch 1
    batch_verify_group: int | None  # the same at batch > 1 (None: engine/packed.py verify_groups decides)
    multi_stop: bool  # whether the native loops end rows on several stop ids

    def final_norm(self, h: Tensor) -> Tensor:
        """The model's final norm, as the native loops compute it."""
        ...

    def logits(self, h: Tensor, lo: int = 0, hi: int = 1) -> Tensor:
        """[..., hi - lo, V] heads lo..hi-1's logits."""
        ...

    def draft_logits(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """[..., hi - lo, len(draft_ids)] heads lo..hi-1's logits over the draft vocabulary (logits without one);
        first [...]: the token before head lo's target, which chained heads read (None: head lo-1's argmax)."""
        ...

    def head1(self, h: Tensor) -> Tensor:
        """[..., V] head 1's logits (the model's own next-token distribution)."""
        ...

    def head1_argmax(self, h: Tensor) -> Tensor:
        """[...] head 1's argmax: greedy's token, the one blockwise verifies against."""
        ...

    def propose(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """[..., hi - lo] heads lo..hi-1's argmax ids (proposals; over the draft vocabulary where set). first [...]:
        the token before head lo's target (head 1's token for lo = 1), which chained heads read (None: computed)."""
        ...

    def greedy_steps(self, model, state, tok: Tensor, room: np.ndarray, max_steps: int, eos=None):
        """Up to max_steps greedy steps in one native call (None where native_loop is None)."""
        ...

    def block_steps(self, model, state, x: np.ndarray, room: int, max_steps: int, eos=None, width: int | None = None):
        """Exact blockwise steps for one row in one native call."""
        ...

    def batch_block_steps(
        self,
        model,
        state,
        x: np.ndarray,
        lengths: np.ndarray,
        room: np.ndarray,
        max_steps: int,
        width: int | None = None,
        eos=None,
    ):
        """Exact blockwise steps for R rows (per-row cache slots) in one native call."""
        ...


def python_greedy_steps(w: DecodeStep, model, state, tok: Tensor, room: np.ndarray, max_steps: int, eos):
    """DecodeStep.greedy_steps where the native loop does not run (CUDA, the torch engine): one decoder call and
    head-1 argmax per step through model.decode and w.head1_argmax, the same steps and returns as the native loop
    (both families' step weights fall back to it). eos: the id or ids that end a row (stop_array)."""
    stops = stop_array(eos)
    w.last_seconds = None
    lengths = state.lengths
    steps, h = [], None
    x = tok[:, None]
    for s in range(max_steps):
        state.lengths = lengths + s
        h = model.decode(state, x)[:, 0]
        nxt = w.head1_argmax(h)
        g = nxt.cpu().numpy()
        steps.append(g)
        x = nxt[:, None]
        if (np.isin(g, stops) | (room <= s + 1)).any():
            break
    state.lengths = lengths
    return (np.stack(steps, axis=1) if steps else np.zeros((tok.shape[0], 0), dtype=np.int64)), h


def native_sampler(temperature: float, top_k: int, top_p: float, seeds, match: bool = False) -> tuple[Tensor, Tensor]:
    """What the native loops take for sampled steps: settings [temperature, top_k, top_p, match] (float64) and each
    row's random stream [R, 2] (int64: its seed and a counter the loop advances). match: blockwise sampling keeps
    a draft only where it is the token plain sampling picks there (engine/csrc/sample.h, Sampler::choose)."""
    settings = torch.tensor([float(temperature), float(top_k), float(top_p), float(match)], dtype=torch.float64)
    rng = torch.tensor([[int(s) % 2**63, 0] for s in seeds], dtype=torch.int64).reshape(-1, 2)
    return settings, rng


def stop_array(eos) -> np.ndarray:
    """The id or ids that end a row (an int, or a sequence or array of ints, as the caller gives them) as one int64
    array [n]: what the native loops take (as a tensor) and the Python steps test against."""
    return np.atleast_1d(np.asarray(eos, dtype=np.int64))


def cache_start(state) -> tuple[int, Tensor | None]:
    """Where the native loops write a state's next token: (base + lengths, None) when every row has the same
    length, else (base, per-row lengths [R] as a tensor)."""
    lengths = state.lengths
    if isinstance(lengths, int):
        return state.base + lengths, None
    return state.base, lengths if isinstance(lengths, Tensor) else torch.from_numpy(np.asarray(lengths))
