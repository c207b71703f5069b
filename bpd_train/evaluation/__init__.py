"""Evaluation: BLEU/chrF (sacrebleu), k̂, agreement, fair speedup timing; JSON/Markdown/PNG reports; the
per-checkpoint BlockwiseEval callback. Submodules import lazily so `bpd_train.evaluation` stays light."""

from bpd_train.decoding.settings import DecodeError as EvalError
from bpd_train.decoding.settings import default_block_sizes, parse_rule
from bpd_train.evaluation.metrics import agreement, corpus_scores

__all__ = ["EvalError", "agreement", "corpus_scores", "default_block_sizes", "parse_rule"]
