"""Translate strings from Python: a bundle, a checkpoint, a run folder or an `hf:` folder in, text out.

    >>> from bpd_train import Translator
    >>> tr = Translator.from_pretrained("artifacts/bible_en_fr/export/both-k8")        # doctest: +SKIP
    >>> out = tr.translate(["In the beginning God created the heavens and the earth."])  # doctest: +SKIP
    >>> out.texts[0], out.mean_accepted, out.calls                                    # doctest: +SKIP

`translate` batches by length (the outputs come back in input order), decodes blockwise by default (exact
acceptance: the model's own greedy output, in fewer decoder calls) and reports k̂ (`mean_accepted`) and the decoder
calls. A decoder-only model answers prompts with `generate` (or translates with `translate` when its prompt
languages are given). Every option is a field of `DecodeSettings`, declared once in bpd_train/decode_settings.py,
from which the `python -m bpd_train.translate` flags and evaluate.py's decode config derive too; all three decode
through bpd_train/decoding/serving.py, so they agree token for token. Texts come back as decoded (line breaks
kept).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

from bpd_train.decode_settings import carried
from bpd_train.decoding.serving import Decoder, decode_texts, prepare
from bpd_train.decoding.settings import DecodeError, DecodeSettings, resolve_dtype

log = logging.getLogger(__name__)
OVERRIDE = "; the dtype keyword overrides"  # after the precision line (the command line's says --dtype)


@dataclass
class Output:
    """What `translate` / `generate` return: one text per input, in input order, and the decoding's counts."""

    texts: list[str]
    tokens: list[list[int]] = field(repr=False)
    mean_accepted: float  # k̂: tokens accepted per decoder call (1.0 for greedy)
    calls: int  # decoder calls after the prefill, all batches together
    method: str

    def __len__(self) -> int:
        return len(self.texts)

    def __iter__(self):
        return iter(self.texts)

    def __getitem__(self, i):
        return self.texts[i]


class Translator:
    """A loaded model and its tokenizer, ready to decode text. Build it with `Translator.from_pretrained`.

    `settings` (a DecodeSettings) and keyword `overrides` (its field names: method, accept, block_size, max_len,
    dtype, draft_top_tokens, proposal_dtype, adaptive, batch_size, lookup, narrow, tree, stop, temperature, top_k,
    top_p, seed; bpd_train/decode_settings.py declares each with its help) are this translator's defaults;
    `translate` / `generate` take the same overrides per call, as transformers' `generate` takes a
    GenerationConfig's fields. Without `settings`, a bundle's own decode settings (the ones its evaluation found
    fastest, `carried_why` says why) are the starting point, as a transformers model's generation_config.json is.
    dtype "auto" (the default) decodes in the fastest precision for the model's file type on this device
    (decoding/settings.py AUTO_DTYPE); the line naming it and why is logged (logger bpd_train.app.api)."""

    def __init__(self, loaded, device, settings: DecodeSettings | None = None, **overrides):
        self.loaded, self.device = loaded, device
        self.model = loaded.model
        self._tokenizer = loaded.tokenizer()
        own, self.carried_why = carried(getattr(loaded, "meta", None), f"bundle {getattr(loaded, 'source', '?')}")
        self.settings = (settings or DecodeSettings(**own)).replace(**overrides)
        self.weight_type: str | None = getattr(loaded, "weight_type", None)  # a GGUF file's, for dtype auto
        self._logged: str | None = None  # the last precision line logged
        # the last call's decoder (decoding/serving.py Decoder): its decode options and packed weights, kept for the
        # next call with the same options
        self.decoder: Decoder | None = None

    @classmethod
    def from_pretrained(
        cls, spec: str | os.PathLike, device: str = "auto", settings: DecodeSettings | None = None, **overrides
    ) -> "Translator":
        """`spec`: a bundle (export.py), a Lightning checkpoint, a run folder, a ZeRO folder or `hf:<folder>` (a
        transformers checkpoint, imported on the fly; docs/models.md). `device`: auto | cpu | cuda | cuda:N.
        `settings` / `overrides`: the decode defaults (see the class)."""
        import torch

        from bpd_train.sources.loading import load

        (settings or DecodeSettings()).replace(**overrides)  # a bad setting fails before the model loads
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        model = load(spec, map_location=device)
        model.model.eval()
        tr = cls(model, device, settings, **overrides)
        tr._log_precision(resolve_dtype(tr.settings, tr.weight_type, device)[1])  # at load, as translate prints it
        return tr

    def _log_precision(self, line: str | None) -> None:
        if line is not None and line != self._logged:
            log.info(line + OVERRIDE)
            self._logged = line

    @property
    def block_size(self) -> int:
        """k: the model's heads (1 = a plain model, greedy only)."""
        return int(self.model.config.block_size)

    @property
    def dtype(self) -> str:
        """The precision it decodes in by default: the settings' dtype, "auto" resolved for the model's file type
        and device (decoding/settings.py auto_dtype)."""
        return resolve_dtype(self.settings, self.weight_type, self.device)[0].dtype

    @property
    def family(self):
        """The model's family (bpd_train/families): `family.prompted` models answer prompts with generate()."""
        return self.loaded.family

    @property
    def is_lm(self) -> bool:
        """A decoder-only model (generate() answers prompts)."""
        return self.family.prompted

    def translate(
        self,
        sentences: Sequence[str],
        *,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        context_policy: str = "truncate_left",
        settings: DecodeSettings | None = None,
        **overrides,
    ) -> Output:
        """Translate `sentences` (a list of str), blockwise with exact acceptance by default (the model's own greedy
        output in fewer decoder calls). `settings` / `overrides`: this call's decode settings, over the translator's
        (e.g. method="greedy", accept="top2", block_size=4, max_len=(1, 5), dtype="int8"; every name and what it
        takes: bpd_train/decode_settings.py, docs/api.md). A decoder-only model translates with its prompt format
        ("English: ...\\nFrench:") given src_lang/tgt_lang; context_policy: a prompt longer than its context is cut
        from the left (truncate_left) or refused."""
        settings = (settings or self.settings).replace(**overrides)
        sentences = _strings(sentences, "sentences")
        if self.family.prompted and not (src_lang and tgt_lang):
            raise DecodeError(
                "a decoder-only model translates with src_lang and tgt_lang (its prompt format), or "
                "answers prompts with .generate()"
            )
        text = self.family.text_adapter(
            self.loaded, src_lang, tgt_lang, context_policy=context_policy, tokenizer=self._tokenizer
        )
        return self._decode(text, sentences, settings)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[dict]],
        *,
        max_new_tokens: int = 128,
        chat: bool = False,
        context_policy: str = "truncate_left",
        settings: DecodeSettings | None = None,
        **overrides,
    ) -> Output:
        """A decoder-only model's answers to `prompts`, each as decoded (line breaks kept): each prompt as it is,
        or (chat=True, or a list of {"role", "content"} messages per prompt) rendered with the tokenizer's chat
        template. At most max_new_tokens tokens each (the max_len setting); the other settings as translate()."""
        if "max_len" in overrides:
            raise DecodeError("generate() takes max_new_tokens=N (not max_len)")
        settings = (settings or self.settings).replace(max_len=max_new_tokens, **overrides)
        if not self.family.prompted:
            raise DecodeError("generate() is for decoder-only models; this is a translation model: use translate()")
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise DecodeError(f"prompts must be a list, got {type(prompts).__name__}")
        items = [[{"role": "user", "content": p}] if chat and isinstance(p, str) else p for p in prompts]
        for i, p in enumerate(items):
            if not isinstance(p, (str, list)):
                raise DecodeError(f"prompts[{i}] is {type(p).__name__}, not a str or a list of chat messages")
        tok = self._tokenizer
        if any(isinstance(p, list) for p in items) and not tok.has_chat_template:
            raise DecodeError("chat prompts need a chat template; this model's tokenizer has none")
        text = self.family.text_adapter(self.loaded, context_policy=context_policy, tokenizer=tok)
        return self._decode(text, items, settings)

    def _decode(self, text, sources, settings: DecodeSettings) -> Output:
        decoder = self.decoder = prepare(
            self.model, self._tokenizer, settings, self.device, reuse=self.decoder, weight_type=self.weight_type
        )
        self._log_precision(decoder.precision)
        out = decode_texts(decoder, text, sources)
        return Output(
            out.texts, out.tokens, out.stats.mean_accepted if decoder.blockwise else 1.0, out.stats.calls, decoder.label
        )


def _strings(xs, what: str) -> list[str]:
    if isinstance(xs, str) or not isinstance(xs, Sequence):
        raise DecodeError(f"{what} must be a list of str, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        if not isinstance(x, str):
            raise DecodeError(f"{what}[{i}] is {type(x).__name__}, not a str")
    return list(xs)
