"""Translate strings from Python: a bundle, a checkpoint, a run folder or an `hf:` folder in, text out.

    >>> from bpd_train import Translator
    >>> tr = Translator.from_pretrained("artifacts/bible_en_fr/export/both-k8")        # doctest: +SKIP
    >>> out = tr.translate(["In the beginning God created the heavens and the earth."])  # doctest: +SKIP
    >>> out.texts[0], out.mean_accepted, out.calls                                    # doctest: +SKIP

`translate` batches by length (the outputs come back in input order), decodes blockwise by default (exact
acceptance: the model's own greedy output, in fewer decoder calls) and reports k̂ (`mean_accepted`) and the decoder
calls. A decoder-only model answers prompts with `generate` (or translates with `translate` when its prompt
languages are given). The `python -m bpd_train.translate` command line and evaluate.py decode through the same
pieces (bpd_train/evaluation/decode.py), so the three agree token for token.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

METHODS = ("blockwise", "greedy")


@dataclass
class Output:
    """What `translate` / `generate` return: one text per input, in input order, and the decoding's counts."""

    texts: list[str]
    tokens: list[list[int]] = field(repr=False)
    mean_accepted: float  # k̂: tokens accepted per decoder call (1.0 for greedy)
    calls: int            # decoder calls after the prefill, all batches together
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
        transformers checkpoint, imported on the fly; docs/HF_IMPORT.md). `device`: auto | cpu | cuda | cuda:N."""
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

    def translate(self, sentences: Sequence[str], batch_size: int = 32, method: str = "blockwise",
                  accept: str = "exact", block_size: int | None = None, max_len=(1.5, 10), dtype: str = "fp32",
                  src_lang: str | None = None, tgt_lang: str | None = None, adaptive: bool | None = None) -> Output:
        """Translate `sentences` (a list of str). method: blockwise (default) | greedy; accept: exact (greedy's
        output) | top<N> | distance:<eps>; block_size: at most the model's k (default k); max_len: an int, or
        (a, b) = a * source_len + b tokens per sentence; dtype: fp32 | bf16 | int8 decode-step weights; adaptive:
        feed only proposals whose heads pay (output unchanged; None: on with the exact rule on the CPU).
        A decoder-only model translates with its prompt format ("English: ...\\nFrench:") given src_lang/tgt_lang."""
        from bpd_train.evaluation.decode import EvalError

        sentences = _strings(sentences, "sentences")
        if self.family.prompted and not (src_lang and tgt_lang):
            raise EvalError("a decoder-only model translates with src_lang and tgt_lang (its prompt format), or "
                            "answers prompts with .generate()")
        text = self.family.text_adapter(self.loaded, src_lang, tgt_lang, tokenizer=self._tokenizer)
        return self._decode(text, sentences, batch_size, method, accept, block_size, max_len, dtype, adaptive)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[dict]], batch_size: int = 32,
                 method: str = "blockwise", accept: str = "exact", block_size: int | None = None,
                 max_new_tokens: int = 128, chat: bool = False,
                 context_policy: str = "truncate_left", adaptive: bool | None = None) -> Output:
        """A decoder-only model's answers to `prompts`: each prompt as it is, or (chat=True, or a list of
        {"role", "content"} messages per prompt) rendered with the tokenizer's chat template. adaptive: as
        translate()."""
        from bpd_train.evaluation.decode import EvalError

        if not self.family.prompted:
            raise EvalError("generate() is for decoder-only models; this is a translation model: use translate()")
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise EvalError(f"prompts must be a list, got {type(prompts).__name__}")
        items = [[{"role": "user", "content": p}] if chat and isinstance(p, str) else p for p in prompts]
        for i, p in enumerate(items):
            if not isinstance(p, (str, list)):
                raise EvalError(f"prompts[{i}] is {type(p).__name__}, not a str or a list of chat messages")
        tok = self._tokenizer
        if any(isinstance(p, list) for p in items) and not tok.has_chat_template:
            raise EvalError("chat prompts need a chat template; this model's tokenizer has none")
        text = self.family.text_adapter(self.loaded, context_policy=context_policy, tokenizer=tok)
        return self._decode(text, items, batch_size, method, accept, block_size, int(max_new_tokens), "fp32",
                            adaptive)

    def _decode(self, text, sources, batch_size, method, accept, block_size, max_len, dtype, adaptive) -> Output:
        import torch

        from bpd_train.data.sampler import length_batches
        from bpd_train.decoding import blockwise, greedy
        from bpd_train.decoding.common import stop_ids
        from bpd_train.evaluation.decode import (EvalError, check_block_sizes, decode_options, max_len_arg,
                                                 parse_rule, serving_adaptive, set_decode_options)
        from bpd_train.evaluation.metrics import DecodeStats, one_line

        if method not in METHODS:
            raise EvalError(f"method={method!r}; expected one of {', '.join(METHODS)}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise EvalError(f"batch_size must be an int >= 1, got {batch_size!r}")
        k = self.block_size if block_size is None else int(block_size)
        if block_size is not None and method == "blockwise":
            check_block_sizes([k], self.block_size, "this model")
        rule, limit = parse_rule(accept), max_len_arg(list(max_len) if isinstance(max_len, tuple) else max_len)
        set_decode_options(self.model, decode_options(self._tokenizer, stop_ids(self.model), dtype,
                                                      device=self.device))
        use_blockwise = method == "blockwise" and k > 1
        adaptive = serving_adaptive(adaptive, rule, self.device)
        ids = [text.source_ids(s) if (not isinstance(s, str) or s.strip()) else None for s in sources]
        todo = [i for i, x in enumerate(ids) if x is not None]  # an empty input gives an empty output
        out_text, out_tokens = [""] * len(sources), [[] for _ in sources]
        stats = DecodeStats()
        with torch.inference_mode():
            for group in length_batches([len(ids[i]) for i in todo], batch_size):
                rows = [todo[j] for j in group]
                src = text.batch([ids[i] for i in rows], self.device)
                if use_blockwise:
                    r = blockwise(self.model, src, block_size=k, accept=rule, max_len=limit, adaptive=adaptive)
                else:
                    r = greedy(self.model, src, max_len=limit)
                stats.add(r)
                for i, toks in zip(rows, r.tokens):
                    out_tokens[i] = list(toks)
                    out_text[i] = one_line(text.detok(toks))
        khat = stats.mean_accepted if use_blockwise else 1.0
        return Output(out_text, out_tokens, khat, stats.calls,
                      f"blockwise k={k} {accept}{' adaptive' if adaptive else ''}" if use_blockwise
                      else "greedy")


def _strings(xs, what: str) -> list[str]:
    from bpd_train.evaluation.decode import EvalError

    if isinstance(xs, str) or not isinstance(xs, Sequence):
        raise EvalError(f"{what} must be a list of str, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        if not isinstance(x, str):
            raise EvalError(f"{what}[{i}] is {type(x).__name__}, not a str")
    return list(xs)
