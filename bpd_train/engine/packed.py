"""What both families' decode-step weights share (engine/mt.py DecodeWeights, engine/lm.py LMDecodeWeights):
`DecodeOptions`, the draft-vocabulary projection, the lazy verification's group sizes, and the key that tells when a
model's step weights must be rebuilt (`weights_key`: every parameter's storage pointer and in-place version counter,
and the options; the cache itself is engine/weights.py `PackedWeights`, which a decoder owns).

`DecodeOptions`:
  dtype        "fp32" | "bf16" | "int8" | "q4": precision of the decode-step weights (encoder stays fp32).
  draft_vocab  None, or the ids heads 2..k may propose (e.g. the N most frequent target tokens). Head 1
               always verifies over the full vocabulary, so the output stays exact; a proposal pass over
               N of V tokens reads N/V of the projection (EAGLE-3's draft vocabulary idea).
  proposal_dtype  None (= dtype), or the precision of the proposal path alone: heads 2..k's FFN and the
               proposal projection. Proposals only decide what head 1 verifies (in `dtype`), so any precision
               keeps the output that of greedy decoding in `dtype`; "int8" reads a quarter of the bytes. (Models
               whose head 1 is not the untouched original path keep `dtype` for the heads.)
  lookup       0, or n: decoder-only models on the native loops propose from the row's own context (prompt and
               answer so far) where its last n (else fewer) tokens occurred before, the heads elsewhere: prompt
               lookup, for answers that copy from their prompt. Proposals only; the output stays greedy's.
  narrow       0, or w >= 1 (with lookup, batch 1): a step whose context repeats fewer than 2 tokens feeds w rows
               (the heads' first w - 1 proposals) instead of the full block; a step with a longer repeat feeds the
               full block. Wide steps where only the heads propose cost more rows than they gain on a CPU.
  tree         () or rank paths (batch 1, decoder-only native loops): a step whose context repeats fewer than 2
               tokens feeds a candidate tree instead (replacing narrow): path (1,) is head 2's second choice after
               the token head 1 verifies, (0, 1) head 2's first then head 3's second; with lookup, a context whose
               last token repeats adds the token that followed it as one more branch. Every node attends to the
               context and its own ancestors only, bit for bit as the chain would, so the output stays greedy's.
               `parse_tree("0 1")` = ((0,), (1,)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from bpd_train.decode_settings import TREE_NODES, parse_tree  # noqa: F401 - re-exported (bench/real.py)
from bpd_train.engine.fastlinear import PackedLinear, l2_bytes, loaded_kernels


@dataclass(frozen=True)
class DecodeOptions:
    """Derived data: built from a checked DecodeSettings (decoding/settings.py decode_options), never checked again
    here. Its fields as above; `draft_vocab` a sorted tuple of ids, `tree` parsed rank paths."""

    dtype: str = "fp32"
    draft_vocab: tuple[int, ...] | None = None
    proposal_dtype: str | None = None
    lookup: int = 0
    narrow: int = 0
    tree: tuple[tuple[int, ...], ...] = ()


def tree_rows(tree) -> int:
    """The most rows a step of this candidate tree feeds: the root, its nodes, the lookup's branch."""
    return len({p[:i] for p in tree for i in range(1, len(p) + 1)}) + 2 if tree else 0


def draft_projection(
    emb: Tensor, bias: Tensor | None, draft_vocab, dtype: str
) -> tuple[Tensor | None, PackedLinear | None]:
    """The draft vocabulary's rows of the output projection (emb [V, d], bias [V] or None), packed in `dtype`:
    (ids [D], projection), or (None, None) without a draft vocabulary. Heads 2..k propose among these ids only."""
    if draft_vocab is None:
        return None, None
    ids = torch.tensor(draft_vocab, dtype=torch.long, device=emb.device)
    if int(ids.max()) >= emb.shape[0] or int(ids.min()) < 0:
        raise ValueError(f"draft_vocab holds ids outside the vocabulary (size {emb.shape[0]})")
    return ids, PackedLinear(
        emb.detach().index_select(0, ids),  # (proposals read only its argmax: screened in fp32)
        bias.index_select(0, ids) if bias is not None else None,
        dtype,
        screen=True,
    )


def verify_groups(proj: PackedLinear) -> tuple[int, int]:
    """Head 1's positions per pass in the native loops' lazy verification: (one row, several rows). Lazy passes
    skip the positions after a rejected proposal, but each pass reads the whole output projection again. One row:
    where the projection (in its packed precision) stays in one core's L2, a row costs its arithmetic, so positions
    go in pairs; where it does not, a pass costs about the same for 1 row as for 4, so every position of the block
    goes in one pass -- with 2 threads too (each reads half, but the decoder's weights stream through the same L2).
    Several rows: each pass is 2+ rows per live row, so arithmetic dominates unless the projection is read from
    memory (larger than 16 MB). The measurements: docs/experiments.md (the CPU decoding engine; bench/engine.py
    --profile / --regimes). A screened fp32 projection (PackedLinear(screen=True)) reads its int8 copy per pass, a
    quarter of the fp32 bytes."""
    one = 8 if proj.argmax_bytes > l2_bytes() else 2
    several = 8 if proj.out_features * proj.in_features * 4 > (16 << 20) else 2
    return one, several


def copy_rows(x: Tensor, dim: int, dst: np.ndarray, src: np.ndarray, limit_dim: int = -1, limit: int = -1) -> None:
    """x's rows dst[i] (along dim) = its rows src[i], in place, the first `limit` entries along limit_dim only where
    limit >= 0; no dst row is a src row. One native call on the CPU where the kernels are loaded (a handful of torch
    ops per row otherwise)."""
    ext = loaded_kernels()
    if ext is not None and x.device.type == "cpu":
        ext.copy_rows(x, dim, dst.tolist(), src.tolist(), limit_dim, limit)
        return
    for d, s in zip(dst.tolist(), src.tolist()):
        a, b = x.select(dim, d), x.select(dim, s)
        if limit >= 0:
            ld = limit_dim - (limit_dim > dim)
            a, b = a.narrow(ld, 0, limit), b.narrow(ld, 0, limit)
        a.copy_(b)


def weights_key(model: nn.Module, options: DecodeOptions) -> tuple:
    """Changes whenever any parameter's storage or in-place version does (training steps, load_state_dict,
    .to()), or the options do."""
    ext = loaded_kernels()
    if ext is not None:
        try:
            return options, ext.param_states(model)
        except Exception:  # a parameter the native walk does not read (no storage, not a tensor): walk in Python
            pass
    out: list = [options]
    _param_states(model, out)
    return tuple(out)


def _param_states(module: nn.Module, out: list) -> None:
    # a plain walk over the module dicts, cheaper than model.parameters() (generators, memo sets); shared
    # parameters just appear twice here. is_cpu, not device.type (which builds a device object per parameter)
    for p in module._parameters.values():
        if p is not None:
            out.append((p.data_ptr(), p._version, p.is_cpu))
    for child in module._modules.values():
        if child is not None:
            _param_states(child, out)
