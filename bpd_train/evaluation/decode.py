"""Where the serving pieces used to live: they are in bpd_train/decoding/ (settings.py, text.py) now; these names
stay importable from here for the callers not yet moved. EvalError is decoding's DecodeError."""
from __future__ import annotations

from bpd_train.decoding.settings import (  # noqa: F401 - re-exported
    AUTO, AUTO_DRAFT_MIN_VOCAB, DecodeError, check_block_sizes, decode_options, default_block_sizes,
    draft_vocabulary, max_len_arg, parse_rule, proposal_precision, set_decode_options,
)
from bpd_train.decoding.text import LMText, SpmText  # noqa: F401 - re-exported

EvalError = DecodeError
