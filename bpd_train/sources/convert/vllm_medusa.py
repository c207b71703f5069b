"""Medusa heads of an LMModel (`heads=medusa`) -> the checkpoint vLLM's `medusa` speculative model loads.

The format, as vLLM reads it (vllm/model_executor/models/medusa.py and vllm/transformers_utils/configs/medusa.py;
tests/test_lm_export_vllm.py replays that loader on our file and names the revisions read):

  config.json        model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size,
                     num_heads (= k-1: vLLM's heads are our future heads 2..k), num_hidden_layers (residual
                     blocks per head), truncated_vocab_size, original_lm_head: true (one projection shared by
                     every head: the base model's), medusa_fc_bias: true (vLLM builds the blocks' Linear layers
                     WITHOUT bias unless this is set, and then silently skips the bias tensors -- heads that
                     worked in training propose garbage: vLLM issue 8620's acceptance 0.000).
                     vLLM's config loader renames every key holding "num" and "heads" to num_heads (and "num"
                     and "layers" to num_hidden_layers), so no other key may contain those words.
  model.safetensors  blocks.{j}.layers.{l}.weight [D,D] and .bias [D] for head j = 0..k-2, block l;
                     lm_head.weight [V,D]; with a draft vocabulary also token_map [N] (ids) and
                     truncated_vocab_size N (vLLM then keeps rows token_map of lm_head).

vLLM feeds the blocks the target model's final hidden state after its final norm, which is what our
MedusaHeads read, and applies lm_head after them with no further norm, as ours does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from bpd_train.io import atomic_dir
from bpd_train.model.heads import MedusaHeads
from bpd_train.sources.convert.common import ConvertError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def medusa_config(model, draft_vocab: Sequence[int] | None = None) -> dict[str, Any]:
    c = model.config
    heads = getattr(model, "heads", None)
    if not isinstance(heads, MedusaHeads):
        kind = getattr(c, "heads", "bpd (encoder-decoder)")
        raise ConvertError(
            f"vLLM's medusa format holds Medusa heads; this model has heads={kind} "
            "(train a decoder-only model with heads=medusa and block_size >= 2)"
        )
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": c.d_model,
        "vocab_size": c.vocab_size,
        "num_heads": c.block_size - 1,
        "num_hidden_layers": heads.n_layers,
        "truncated_vocab_size": len(draft_vocab) if draft_vocab is not None else c.vocab_size,
        "original_lm_head": True,
        "medusa_fc_bias": True,
        "max_paths": 64,
        "topk": 10,
    }


def medusa_tensors(model, draft_vocab: Sequence[int] | None = None, dtype: str = "float32") -> dict[str, Tensor]:
    medusa_config(model, draft_vocab)  # refuses other heads
    if dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dt = DTYPES[dtype]
    heads = model.heads
    out = {}
    for j in range(heads.k - 1):
        for layer in range(heads.n_layers):
            out[f"blocks.{j}.layers.{layer}.weight"] = heads.weight[j, layer]
            out[f"blocks.{j}.layers.{layer}.bias"] = heads.bias[j, layer]
    out["lm_head.weight"] = model.output_weight()
    out = {k: v.detach().to("cpu", dt).contiguous().clone() for k, v in out.items()}
    if draft_vocab is not None:
        ids = sorted({int(i) for i in draft_vocab})
        if not ids or ids[0] < 0 or ids[-1] >= model.config.vocab_size:
            raise ConvertError(f"draft_vocab must hold ids in 0..{model.config.vocab_size - 1}")
        out["token_map"] = torch.tensor(ids, dtype=torch.long)
    return out


def _written_here(folder: Path) -> bool:
    """An earlier export_medusa folder (overwrite replaces only those)."""
    names = {p.name for p in folder.iterdir()}
    if not names <= {"config.json", "model.safetensors"}:
        return False
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "medusa"
    except (OSError, ValueError):
        return False


def export_medusa(
    model,
    out_dir: str | Path,
    *,
    draft_vocab: Sequence[int] | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write config.json + model.safetensors for vLLM's `medusa` speculative model (atomic: the folder
    appears complete or not at all). Serve with the base model as target and this folder as the draft
    (`speculative_config={"method": "medusa", "model": <out_dir>, "num_speculative_tokens": k-1}`)."""
    from safetensors.torch import save_file

    if draft_vocab is not None:
        draft_vocab = sorted({int(i) for i in draft_vocab})
    cfg = medusa_config(model, draft_vocab)
    tensors = medusa_tensors(model, draft_vocab, dtype)
    with atomic_dir(out_dir, overwrite=overwrite, replaceable=_written_here) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)
