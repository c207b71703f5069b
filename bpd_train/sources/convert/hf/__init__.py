"""transformers checkpoints <-> this project's models, one file per model family with the same names as
bpd_train/model/ (mt.py: Marian, M2M100 / NLLB, Pegasus for export; lm.py: Llama, Qwen2, Mistral); what both share
(reading folders and weights, the export folder) is convert/common.py's."""

from bpd_train.sources.convert.common import HEADS_FILE, ConvertError
from bpd_train.sources.convert.hf.lm import load_hf_lm, to_hf_lm
from bpd_train.sources.convert.hf.mt import from_hf, load_hf, to_hf

__all__ = ["HEADS_FILE", "ConvertError", "from_hf", "load_hf", "load_hf_lm", "to_hf", "to_hf_lm"]
