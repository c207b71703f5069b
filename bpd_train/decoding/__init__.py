"""Batched, KV-cached decoders: greedy (reference), beam search, blockwise parallel decoding, sampling (plain and
blockwise)."""

from bpd_train.decoding.acceptance import AcceptanceRule, Distance, Exact, TopK, make_acceptance
from bpd_train.decoding.beam import BeamSearchPolicy, beam_search
from bpd_train.decoding.blockwise import blockwise
from bpd_train.decoding.common import DEFAULT_MAX_LEN, MaxLen, parse_max_len
from bpd_train.decoding.greedy import greedy
from bpd_train.decoding.result import DecodeResult
from bpd_train.decoding.sampling import sample
from bpd_train.decoding.speculative import speculative_sample

__all__ = [
    "AcceptanceRule",
    "BeamSearchPolicy",
    "DecodeResult",
    "Distance",
    "Exact",
    "TopK",
    "beam_search",
    "blockwise",
    "greedy",
    "make_acceptance",
    "DEFAULT_MAX_LEN",
    "MaxLen",
    "parse_max_len",
    "sample",
    "speculative_sample",
]
