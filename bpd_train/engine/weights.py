"""The packed-weight cache a decoder owns: `PackedWeights` holds one `DecodeOptions` and the step weights built for
a model under them (engine/mt.py `DecodeWeights` for the encoder-decoder, engine/lm.py `LMDecodeWeights` for the
decoder-only model), rebuilt whenever a parameter changed (optimizer step, load_state_dict, .to()): the key holds
every parameter's storage pointer and in-place version counter. The model carries none of this: the serving path's
decoder (decoding/serving.py `Decoder`) owns one and hands it to greedy / blockwise / beam search / sampling; a
decoder called without one uses `default_weights(model)` (fp32, no draft vocabulary), kept beside the model in a
weak mapping, so that it dies with the model and never travels with copies or pickles of it."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from bpd_train.engine.lm import LMDecodeWeights
from bpd_train.engine.mt import DecodeWeights
from bpd_train.engine.packed import DecodeOptions, weights_key
from bpd_train.engine.step import DecodeStep


def build_step_weights(model: nn.Module, options: DecodeOptions) -> DecodeStep:
    """A model's step weights under `options`, built now. What the engine does not look up in a model it reads as
    data the model declares: `decoder_only` (which family's weights), `medusa_heads` (the heads' kind) and the ids
    that end a row (eos_ids where the config lists several, else eos_id: decoding/common.py stop_ids's rule)."""
    if getattr(model, "decoder_only", False):
        c = model.config
        return LMDecodeWeights(model, options, medusa=bool(model.medusa_heads), stops=c.eos_ids or c.eos_id)
    return DecodeWeights(model, options)


class PackedWeights:
    """One decoder's DecodeOptions and the step weights packed for them, per model: `get(model)` returns them,
    rebuilt only when a parameter or the model changed. `cached` is the last weights built (unchecked)."""

    def __init__(self, options: DecodeOptions | None = None):
        self.options = options if options is not None else DecodeOptions()
        self._cache: tuple | None = None  # (weights_key, step weights)

    def get(self, model: nn.Module) -> DecodeStep:
        """The step weights for `model` under these options; built (or rebuilt) when a parameter changed. A decoding
        call checks once (decoding/common.py decoding_mode): walking every parameter is not free."""
        key = weights_key(model, self.options)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                built = build_step_weights(model, self.options)
            # keyed as the next call reads it: the first build of a process loads the native kernels, which read
            # the key natively from then on (a key taken before would never match: the weights packed twice)
            self._cache = (weights_key(model, self.options), built)
        return self._cache[1]

    @property
    def cached(self) -> DecodeStep | None:
        """The step weights last built, unchecked (None before the first get)."""
        return self._cache[1] if self._cache is not None else None

    def clear(self) -> None:
        """Drop the packed weights (the next get rebuilds them)."""
        self._cache = None

    def __getstate__(self):  # copies and pickles carry the options, never packed weights
        return {"options": self.options, "_cache": None}


_DEFAULTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_weights(model: nn.Module) -> PackedWeights:
    """The packed-weight cache of a model decoded without a decoder's own (default DecodeOptions: fp32, full
    vocabulary), one per model for as long as the model lives."""
    got = _DEFAULTS.get(model)
    if got is None:
        got = _DEFAULTS[model] = PackedWeights()
    return got
