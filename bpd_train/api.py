"""Translate strings from Python: a bundle, a checkpoint, a run folder or an `hf:` folder in, text out.

    >>> from bpd_train import Translator
    >>> tr = Translator.from_pretrained("artifacts/bible_en_fr/export/both-k8")        # doctest: +SKIP
    >>> out = tr.translate(["In the beginning God created the heavens and the earth."])  # doctest: +SKIP
    >>> out.texts[0], out.mean_accepted, out.calls                                    # doctest: +SKIP

`translate` batches by length (the outputs come back in input order), decodes blockwise by default (exact
acceptance: the model's own greedy output, in fewer decoder calls) and reports k̂ (`mean_accepted`) and the decoder
calls. A decoder-only model answers prompts with `generate` (or translates with `translate` when its prompt
languages are given). Every option is a field of `bpd_train.decoding.settings.DecodeSettings`, which the
`python -m bpd_train.translate` command line and evaluate.py build too, and all three decode through
bpd_train/decoding/serving.py, so they agree token for token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from bpd_train.decoding.serving import decode_texts, prepare
from bpd_train.decoding.settings import DEFAULT_MAX_LEN, DecodeError, DecodeSettings


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
    """A loaded model and its tokenizer, ready to decode text. Build it with `Translator.from_pretrained`."""

    def __init__(self, loaded, device):
        self.loaded, self.device = loaded, device
        self.model = loaded.model
        self._tokenizer = loaded.tokenizer()

    @classmethod
    def from_pretrained(cls, spec: str | os.PathLike, device: str = "auto") -> "Translator":
        """`spec`: a bundle (export.py), a Lightning checkpoint, a run folder, a ZeRO folder or `hf:<folder>` (a
        transformers checkpoint, imported on the fly; docs/models.md). `device`: auto | cpu | cuda | cuda:N."""
        import torch

        from bpd_train.loading import load

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        model = load(spec, map_location=device)
        model.model.eval()
        return cls(model, device)

    @property
    def block_size(self) -> int:
        """k: the model's heads (1 = a plain model, greedy only)."""
        return int(self.model.config.block_size)

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
        batch_size: int = 32,
        method: str = "blockwise",
        accept: str = "exact",
        block_size: int | None = None,
        max_len=DEFAULT_MAX_LEN,
        dtype: str = "fp32",
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        adaptive: bool | None = None,
        *,
        draft_vocab="auto",
        proposal_dtype="auto",
        context_policy: str = "truncate_left",
        lookup: int = 0,
        narrow: int = 0,
        tree=(),
    ) -> Output:
        """Translate `sentences` (a list of str). method: blockwise (default) | greedy; accept: exact (greedy's
        output) | top<N> | distance:<eps>; block_size: at most the model's k (default k); max_len: an int, or
        (a, b) = a * source_len + b tokens per sentence; dtype: fp32 | bf16 | int8 decode-step weights; adaptive:
        feed only proposals whose heads pay (output unchanged; None: on with the exact rule on the CPU);
        draft_vocab: heads 2..k propose among the N most frequent tokens (auto | N | None: all); proposal_dtype:
        heads 2..k in bf16 | int8 (auto: int8 on a CPU with the int8 kernels; None: dtype); lookup: N > 0 also
        proposes from the prompt and answer so far (decoder-only; output unchanged); narrow: with lookup, a step
        whose context repeats fewer than 2 tokens feeds this many rows (0: the full block); tree: one row, such a
        step feeds a candidate tree of the heads' ranked proposals instead ("0;1": head 2's top two). Options as
        bpd_train.decoding.settings.DecodeSettings checks them. A decoder-only model translates with its prompt
        format ("English: ...\\nFrench:") given src_lang/tgt_lang; context_policy: a prompt longer than its context
        is cut from the left (truncate_left) or refused."""
        settings = DecodeSettings(
            method=method,
            accept=accept,
            block_size=block_size,
            max_len=max_len,
            dtype=dtype,
            draft_vocab=draft_vocab,
            proposal_dtype=proposal_dtype,
            adaptive=adaptive,
            batch_size=batch_size,
            lookup=lookup,
            narrow=narrow,
            tree=tree,
        )
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
        batch_size: int = 32,
        method: str = "blockwise",
        accept: str = "exact",
        block_size: int | None = None,
        max_new_tokens: int = 128,
        chat: bool = False,
        context_policy: str = "truncate_left",
        adaptive: bool | None = None,
        *,
        dtype: str = "fp32",
        draft_vocab="auto",
        proposal_dtype="auto",
        lookup: int = 0,
        narrow: int = 0,
        tree=(),
    ) -> Output:
        """A decoder-only model's answers to `prompts`: each prompt as it is, or (chat=True, or a list of
        {"role", "content"} messages per prompt) rendered with the tokenizer's chat template. At most
        max_new_tokens tokens each; the other options as translate()."""
        settings = DecodeSettings(
            method=method,
            accept=accept,
            block_size=block_size,
            max_len=max_new_tokens,
            dtype=dtype,
            draft_vocab=draft_vocab,
            proposal_dtype=proposal_dtype,
            adaptive=adaptive,
            batch_size=batch_size,
            lookup=lookup,
            narrow=narrow,
            tree=tree,
        )
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
        decoder = prepare(self.model, self._tokenizer, settings, self.device)
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
