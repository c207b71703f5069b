"""transformers translation checkpoints <-> BPDModel: Marian (opus-mt), M2M100 / NLLB, and Pegasus for export.

Import reads a checkpoint folder itself (no transformers needed) and sets the BPDConfig architecture options that
make the model compute what transformers computes; this project's own models are written as Pegasus with the model
dimension permuted (interleaved -> halves sinusoids), exactly invertible. The option table, the eps and float64
caveats and the heads file are in docs/models.md. Folders, weights, hub ids and the export folder: convert/common.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bpd_train.data.hf_tokenizer import HFTokenizer, TokenizerError
from bpd_train.model.layers import sinusoidal_table
from bpd_train.model.mt.config import BPDConfig
from bpd_train.model.mt.model import BPDModel
from bpd_train.sources.convert.common import (
    HEADS_FILE,
    HEADS_FORMAT,
    ConvertError,
    check_buildable,
    is_hf_export,
    read_configs,
    read_heads,
    read_json,
    read_weights,
    resolve,
    write_hf_folder,
)

SUPPORTED = {
    "MarianMTModel": "marian",
    "M2M100ForConditionalGeneration": "m2m_100",
    "PegasusForConditionalGeneration": "pegasus",
}
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}
_HF_EPS = 1e-5  # nn.LayerNorm's default, which both families use and neither config can change
_ARCHITECTURES = {
    "pegasus": "PegasusForConditionalGeneration",
    "marian": "MarianMTModel",
    "m2m_100": "M2M100ForConditionalGeneration",
}
_GENERATION_KEYS = ("bad_words_ids", "forced_bos_token_id", "decoder_start_token_id")


def _supported() -> str:
    return ", ".join(f"{a} (model_type {t})" for a, t in SUPPORTED.items()) + "; NLLB-200 is M2M100"


def family(hf: dict[str, Any]) -> str:
    """'marian' or 'm2m_100'; anything else is refused with the list of what converts."""
    archs = hf.get("architectures") or []
    mtype = hf.get("model_type")
    for a in archs:
        if a in SUPPORTED:
            return SUPPORTED[a]
    if not archs and mtype in SUPPORTED.values():
        return mtype
    what = ", ".join(archs) or "no architectures"
    raise ConvertError(f"unsupported architecture {what} (model_type {mtype}); bpd-train converts {_supported()}")


# ------------------------------------------------------------------------------------------ HF -> ours
def _one_id(v, name: str) -> int:
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            raise ConvertError(f"{name} lists several ids {v}; bpd-train decodes with one")
        v = v[0]
    if v is None:
        raise ConvertError(f"config.json has no {name}")
    return int(v)


def _other(hf: dict[str, Any], key: str, encoder_key: str) -> int | None:
    """The decoder's value where it differs from the encoder's (BPDConfig's n_decoder_heads / d_ff_decoder)."""
    v = hf.get(key)
    return None if v is None or int(v) == int(hf[encoder_key]) else int(v)


def config_from_hf(
    hf: dict[str, Any],
    generation: dict[str, Any] | None = None,
    *,
    block_size: int = 1,
    head_d_hidden: int | None = None,
    identity_p1: bool = True,
    tgt_lang_id: int | None = None,
    unk_id: int | None = None,
    dropout: float | None = None,
) -> BPDConfig:
    """The BPDConfig that computes what transformers computes for this config.json. tgt_lang_id (M2M100 /
    NLLB): the forced target-language token, which becomes the BOS after the decoder-start prefix."""
    fam = family(hf)
    gen = generation or {}
    act = _ACTIVATIONS.get(str(hf.get("activation_function", "relu")))
    if act is None:
        raise ConvertError(
            f"activation_function {hf.get('activation_function')!r} is not supported "
            f"(supported: {', '.join(_ACTIVATIONS)})"
        )
    pad = _one_id(hf.get("pad_token_id"), "pad_token_id")
    eos = _one_id(hf.get("eos_token_id"), "eos_token_id")
    start = gen.get("decoder_start_token_id")
    start = _one_id(start if start is not None else hf.get("decoder_start_token_id"), "decoder_start_token_id")
    vocab = int(hf["vocab_size"])
    common = dict(
        d_model=int(hf["d_model"]),
        n_heads=int(hf["encoder_attention_heads"]),
        n_encoder_layers=int(hf["encoder_layers"]),
        n_decoder_layers=int(hf["decoder_layers"]),
        d_ff=int(hf["encoder_ffn_dim"]),
        n_decoder_heads=_other(hf, "decoder_attention_heads", "encoder_attention_heads"),
        d_ff_decoder=_other(hf, "decoder_ffn_dim", "encoder_ffn_dim"),
        dropout=float(hf.get("dropout", 0.1) if dropout is None else dropout),
        max_positions=int(hf.get("max_position_embeddings", 1024)),
        block_size=int(block_size),
        head_d_hidden=head_d_hidden,
        identity_p1=identity_p1,
        pad_id=pad,
        eos_id=eos,
        norm_eps=_HF_EPS,
        activation=act,
        scale_embedding=bool(hf.get("scale_embedding", False)),
        tie_output=bool(hf.get("tie_word_embeddings", True)),
        suppress_ids=tuple(sorted({int(w[0]) for w in (gen.get("bad_words_ids") or []) if len(w) == 1})),
    )
    if fam == "pegasus":
        return BPDConfig(
            vocab_size=vocab,
            bos_id=start,
            unk_id=2 if unk_id is None else unk_id,
            pre_norm=True,
            final_norm=True,
            pos_layout="marian",
            pos_offset=0,
            logits_bias=True,
            **common,
        )
    if fam == "marian":
        if tgt_lang_id is not None:
            raise ConvertError(
                "Marian models have no forced target-language token; multi-target opus-mt models "
                "take the >>lang<< code at the start of the source text"
            )
        shared = bool(hf.get("share_encoder_decoder_embeddings", True))
        dec_vocab = int(hf.get("decoder_vocab_size") or vocab)
        return BPDConfig(
            vocab_size=vocab if shared else dec_vocab,
            src_vocab_size=None if shared else vocab,
            share_embeddings=shared,
            bos_id=start,
            unk_id=1 if unk_id is None else unk_id,
            pre_norm=False,
            final_norm=False,
            pos_layout="marian",
            pos_offset=0,
            logits_bias=True,
            **common,
        )
    forced = tgt_lang_id if tgt_lang_id is not None else gen.get("forced_bos_token_id")
    prefix = (start,) if forced is not None else ()
    return BPDConfig(
        vocab_size=vocab,
        bos_id=int(forced) if forced is not None else start,
        decoder_prefix=prefix,
        unk_id=3 if unk_id is None else unk_id,
        pre_norm=True,
        final_norm=True,
        pos_layout="fairseq",
        pos_offset=pad + 1,
        logits_bias=False,
        **common,
    )


def _layer_map(prefix: str, ours: str, decoder: bool) -> list[tuple[str, list[str]]]:
    """(our name, [HF names concatenated on dim 0]) for one layer's tensors."""
    pairs = []
    for wb in ("weight", "bias"):
        pairs += [(f"{ours}.norm1.{wb}", [f"{prefix}.self_attn_layer_norm.{wb}"])]
        attn = "self_attn" if decoder else "attn"
        pairs += [
            (f"{ours}.{attn}.qkv.{wb}", [f"{prefix}.self_attn.{p}_proj.{wb}" for p in "qkv"]),
            (f"{ours}.{attn}.out.{wb}", [f"{prefix}.self_attn.out_proj.{wb}"]),
        ]
        if decoder:
            pairs += [
                (f"{ours}.norm2.{wb}", [f"{prefix}.encoder_attn_layer_norm.{wb}"]),
                (f"{ours}.cross_attn.q.{wb}", [f"{prefix}.encoder_attn.q_proj.{wb}"]),
                (f"{ours}.cross_attn.kv.{wb}", [f"{prefix}.encoder_attn.{p}_proj.{wb}" for p in "kv"]),
                (f"{ours}.cross_attn.out.{wb}", [f"{prefix}.encoder_attn.out_proj.{wb}"]),
                (f"{ours}.norm3.{wb}", [f"{prefix}.final_layer_norm.{wb}"]),
            ]
        else:
            pairs += [(f"{ours}.norm2.{wb}", [f"{prefix}.final_layer_norm.{wb}"])]
        pairs += [(f"{ours}.ffn.fc1.{wb}", [f"{prefix}.fc1.{wb}"]), (f"{ours}.ffn.fc2.{wb}", [f"{prefix}.fc2.{wb}"])]
    return pairs


def _name_map(config: BPDConfig) -> list[tuple[str, list[str]]]:
    """Every backbone tensor of ours and the HF tensors it is made of (embeddings handled separately)."""
    pairs = []
    for i in range(config.n_encoder_layers):
        pairs += _layer_map(f"model.encoder.layers.{i}", f"encoder_layers.{i}", decoder=False)
    for i in range(config.n_decoder_layers):
        pairs += _layer_map(f"model.decoder.layers.{i}", f"decoder_layers.{i}", decoder=True)
    if config.final_norm:
        for wb in ("weight", "bias"):
            pairs += [
                (f"encoder_norm.{wb}", [f"model.encoder.layer_norm.{wb}"]),
                (f"decoder_norm.{wb}", [f"model.decoder.layer_norm.{wb}"]),
            ]
    return pairs


def state_from_hf(sd: dict[str, Tensor], config: BPDConfig) -> dict[str, Tensor]:
    """HF tensors -> our backbone state dict (no heads)."""
    if not any(k.startswith("model.") for k in sd):  # saved from the bare MarianModel / M2M100Model
        sd = {f"model.{k}" if not k.startswith(("lm_head", "final_logits_bias")) else k: v for k, v in sd.items()}

    def get(*names: str) -> Tensor:
        for n in names:
            if n in sd:
                return sd[n]
        raise ConvertError(f"the checkpoint lacks {names[0]}: not a complete {_supported().split(';')[0]} checkpoint")

    out: dict[str, Tensor] = {}
    for ours, theirs in _name_map(config):
        out[ours] = torch.cat([get(t) for t in theirs], dim=0) if len(theirs) > 1 else get(theirs[0])
    if config.share_embeddings:
        out["embed.weight"] = get(
            "model.shared.weight", "model.decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight"
        )
    else:
        out["embed.weight"] = get("model.decoder.embed_tokens.weight")
        out["src_embed.weight"] = get("model.encoder.embed_tokens.weight")
    if not config.tie_output:
        out["lm_head.weight"] = get("lm_head.weight")
    if config.logits_bias:
        out["logits_bias"] = (
            sd["final_logits_bias"].reshape(-1) if "final_logits_bias" in sd else torch.zeros(config.vocab_size)
        )
    for side in ("encoder", "decoder"):  # older Marian files store the (fixed) position table: it must be ours
        table = sd.get(f"model.{side}.embed_positions.weight")
        if table is not None:
            n = min(table.shape[0], config.max_positions)
            ours = sinusoidal_table(n, config.d_model, config.pos_layout, config.pos_offset)
            if table.shape[1] != config.d_model or not torch.allclose(table[:n].float(), ours, atol=1e-4):
                raise ConvertError(
                    f"model.{side}.embed_positions.weight is not the sinusoid table transformers "
                    "builds for this architecture (learned positions are not supported)"
                )
    v = out["embed.weight"].shape[0]
    if v != config.vocab_size:
        raise ConvertError(f"config.json says vocab_size {config.vocab_size} but the embedding has {v} rows")
    return {k: t.contiguous() for k, t in out.items()}


def from_hf(
    folder: str | Path,
    *,
    block_size: int = 1,
    head_d_hidden: int | None = None,
    identity_p1: bool = True,
    tgt_lang_id: int | None = None,
    unk_id: int | None = None,
    dropout: float | None = None,
) -> tuple[BPDConfig, dict[str, Tensor]]:
    """A transformers checkpoint folder -> (BPDConfig, backbone state dict). Heads are not read here."""
    folder = Path(folder)
    hf, gen = read_configs(folder)
    family(hf)  # refuse before reading gigabytes
    # older checkpoints (most opus-mt) keep generation settings such as bad_words_ids in config.json
    gen = {**{k: hf[k] for k in _GENERATION_KEYS if hf.get(k) is not None}, **gen}
    try:
        config = config_from_hf(
            hf,
            gen,
            block_size=block_size,
            head_d_hidden=head_d_hidden,
            identity_p1=identity_p1,
            tgt_lang_id=tgt_lang_id,
            unk_id=unk_id,
            dropout=dropout,
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConvertError):
            raise
        what = f"lacks {e.args[0]!r}" if isinstance(e, KeyError) else f"holds a value of the wrong type or range ({e})"
        raise ConvertError(f"{folder / 'config.json'} {what}") from None
    return config, state_from_hf(read_weights(folder), config)


# ------------------------------------------------------------------------------------------ ours -> HF
def hf_family_of(config: BPDConfig) -> str:
    """The transformers architecture that computes what this config does (docs/models.md), or a ConvertError."""
    c = config
    shared_pre_norm = c.pre_norm and c.final_norm and c.share_embeddings
    if shared_pre_norm and c.pos_layout == "interleaved" and c.pos_offset == 0 and not c.decoder_prefix:
        return "pegasus"  # a native model (permuted on the way out); its eps may differ
    if abs(c.norm_eps - _HF_EPS) > 1e-12:
        raise ConvertError(
            f"norm_eps {c.norm_eps} of an imported-architecture model has no transformers "
            "equivalent (Marian, M2M100 and Pegasus use 1e-5)"
        )
    if c.pos_layout == "marian" and c.pos_offset == 0 and not c.decoder_prefix:
        if not c.pre_norm and not c.final_norm:
            return "marian"
        if shared_pre_norm:
            return "pegasus"
    if shared_pre_norm and c.pos_layout == "fairseq" and c.pos_offset == c.pad_id + 1 and len(c.decoder_prefix) <= 1:
        return "m2m_100"
    raise ConvertError(
        "this model's architecture (pre_norm/final_norm/pos_layout/pos_offset/decoder_prefix) "
        f"matches no transformers family bpd-train writes ({_supported()})"
    )


def needs_permutation(config: BPDConfig) -> bool:
    """Native models: interleaved sinusoids, written as Pegasus with the model dimension permuted."""
    return config.pos_layout == "interleaved"


def _halves_perm(d: int) -> Tensor:
    """Model-dimension index map interleaved -> halves: new[j] = old[perm[j]] (sin dims first, then cos)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def permute_model_dim(state: dict[str, Tensor], config: BPDConfig, perm: Tensor) -> dict[str, Tensor]:
    """Reorder the model (residual-stream) dimension of every tensor by `perm`: the network computes the
    same function with its hidden states permuted. Attention-head and ffn dimensions are not touched."""
    d = config.d_model
    out = {}
    for name, t in state.items():
        leaf = name.rsplit(".", 2)
        kind, wb = (leaf[-2] if len(leaf) > 1 else ""), leaf[-1]
        if name in ("embed.weight", "src_embed.weight", "lm_head.weight"):
            t = t[:, perm]
        elif kind.startswith("norm") or name.startswith(("encoder_norm.", "decoder_norm.")):
            t = t[perm]
        elif name == "heads.fc2.weight":  # k-1 (or k) stacked [D, k*hidden] blocks
            t = t.view(-1, d, t.shape[-1])[:, perm].reshape(t.shape)
        elif name == "heads.fc2.bias":
            t = t.view(-1, d)[:, perm].reshape(t.shape)
        elif kind in ("qkv", "q", "kv", "fc1") and wb == "weight":  # reads the residual stream
            t = t[:, perm]
        elif kind in ("out", "fc2"):  # writes the residual stream
            t = t[perm] if wb == "bias" else t[perm, :]
        out[name] = t.contiguous()
    return out


def hf_config_of(config: BPDConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) of the transformers model equal to ours."""
    c = config
    fam = hf_family_of(c)
    act = {"relu": "relu", "gelu": "gelu", "swish": "swish"}[c.activation]
    common = {
        "d_model": c.d_model,
        "encoder_layers": c.n_encoder_layers,
        "decoder_layers": c.n_decoder_layers,
        "encoder_attention_heads": c.n_heads,
        "decoder_attention_heads": c.decoder_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.decoder_ff,
        "activation_function": act,
        "max_position_embeddings": c.max_positions,
        "scale_embedding": c.scale_embedding,
        "pad_token_id": c.pad_id,
        "eos_token_id": c.eos_id,
        "dropout": c.dropout,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "tie_word_embeddings": c.tie_output,
        "is_encoder_decoder": True,
        "use_cache": True,
    }
    gen = {
        "pad_token_id": c.pad_id,
        "eos_token_id": c.eos_id,
        "num_beams": 1,
        "do_sample": False,
        "max_length": c.max_positions,
    }
    if c.suppress_ids:
        gen["bad_words_ids"] = [[i] for i in c.suppress_ids]
    start = c.decoder_prefix[0] if fam == "m2m_100" and c.decoder_prefix else c.bos_id
    cfg = {
        "architectures": [_ARCHITECTURES[fam]],
        "model_type": fam,
        "vocab_size": c.vocab_size,
        "decoder_start_token_id": start,
        **({"bos_token_id": 0} if fam == "m2m_100" else {"forced_eos_token_id": None, "bos_token_id": None}),
        **common,
    }
    if fam == "marian":  # separate source and target vocabularies
        cfg.update(
            vocab_size=c.source_vocab_size,
            decoder_vocab_size=c.vocab_size,
            share_encoder_decoder_embeddings=c.share_embeddings,
        )
    gen["decoder_start_token_id"] = start
    if fam == "m2m_100" and c.decoder_prefix:
        gen["forced_bos_token_id"] = c.bos_id
    return cfg, gen


def state_to_hf(model) -> dict[str, Tensor]:
    """Our backbone -> HF tensor names, as transformers saves them: tied tensors written once, the shared embedding
    under each of its names when the output projection is separate."""
    c = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if needs_permutation(c):
        sd = permute_model_dim(sd, c, _halves_perm(c.d_model))
    out: dict[str, Tensor] = {}
    for ours, theirs in _name_map(c):
        parts = sd[ours].split([sd[ours].shape[0] // len(theirs)] * len(theirs), dim=0)
        for t, p in zip(theirs, parts):
            out[t] = p
    if c.share_embeddings:
        out["model.shared.weight"] = sd["embed.weight"]
        if not c.tie_output:  # transformers then ties nothing to model.shared: it saves (and reads) every name
            out["model.encoder.embed_tokens.weight"] = out["model.decoder.embed_tokens.weight"] = sd["embed.weight"]
    else:
        out["model.decoder.embed_tokens.weight"] = sd["embed.weight"]
        out["model.encoder.embed_tokens.weight"] = sd["src_embed.weight"]
    if not c.tie_output:
        out["lm_head.weight"] = sd["lm_head.weight"]
    if hf_family_of(c) in ("marian", "pegasus"):
        bias = sd.get("logits_bias", torch.zeros(c.vocab_size))
        out["final_logits_bias"] = bias.reshape(1, -1)
    elif "logits_bias" in sd and bool(sd["logits_bias"].any()):
        raise ConvertError("M2M100 has no logits bias, and this model's is not zero")
    return {k: v.clone().contiguous() for k, v in out.items()}


def heads_tensors(model) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The BPD heads file: tensors heads.fc1/fc2 in the transformers model's basis (they apply to its decoder
    states) and metadata (format, version, the full BPDConfig, the model-dimension permutation if any)."""
    c = model.config
    if getattr(c, "head_chain", False):
        raise ConvertError(
            "chained heads (model.head_chain=true) have no transformers heads-file format; export "
            "this model as a bundle (export.format=bundle), which keeps them"
        )
    tensors = {
        k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items() if k.startswith("heads.")
    }
    meta = {
        "format": HEADS_FORMAT,
        "version": "1",
        "bpd_config": json.dumps(c.to_dict(), sort_keys=True),
        "permutation": "none",
    }
    if needs_permutation(c):
        tensors = permute_model_dim(tensors, c, _halves_perm(c.d_model))
        meta["permutation"] = "interleaved-to-halves"
    return tensors, meta


def to_hf(
    model,
    out_dir: str | Path,
    tokenizer_folder: str | Path | None = None,
    tokenizer_files: list[str] | None = None,
    overwrite: bool = False,
    files: dict[str, str | Path] | None = None,
) -> Path:
    """Write `model` as a transformers checkpoint folder (config.json, generation_config.json,
    model.safetensors), its heads in bpd_heads.safetensors, and the tokenizer files (copied from
    tokenizer_folder, or `files`: name in the folder -> file to copy). Atomic: the folder appears complete or
    not at all; overwrite replaces only an earlier export (is_hf_export)."""
    cfg, gen = hf_config_of(model.config)
    heads, meta = heads_tensors(model)
    copies = {name: Path(tokenizer_folder) / name for name in tokenizer_files or []} if tokenizer_folder else {}
    copies.update({name: Path(f) for name, f in (files or {}).items()})
    return write_hf_folder(
        out_dir, cfg, gen, state_to_hf(model), heads, meta, copies, overwrite, replaceable=is_hf_export
    )


def load_hf(
    path_or_id: str | Path,
    *,
    block_size: int | None = None,
    head_d_hidden: int | None = None,
    identity_p1: bool = True,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    tokenizer: bool = True,
    dropout: float | None = None,
    map_location="cpu",
):
    """`hf:<folder or hub id>` -> (BPDModel in eval mode, HFTokenizer or None, meta).

    block_size: k heads; None takes the k of a bpd_heads.safetensors beside the checkpoint (its trained heads
    are loaded), else 1. M2M100/NLLB need src_lang and tgt_lang (or the tokenizer_config.json's) when the
    tokenizer is loaded: the target language is forced as the decoder's first token."""
    folder, hub_id = resolve(path_or_id)
    hf = read_json(folder / "config.json")
    fam = family(hf)
    saved = read_heads(folder, "bpd_config", BPDConfig)
    tok = None
    tgt_id = None
    try:
        if tokenizer:
            tok = HFTokenizer(folder, src_lang=src_lang, tgt_lang=tgt_lang)
            if fam == "m2m_100":
                if not tok.src_lang or not tok.tgt_lang:
                    raise ConvertError(
                        f"{folder} is an M2M100/NLLB model: give src_lang and tgt_lang "
                        "(e.g. en/de for M2M100, eng_Latn/deu_Latn for NLLB)"
                    )
                tgt_id = tok.tgt_lang_id
        elif tgt_lang is not None:
            raise ConvertError("tgt_lang needs the tokenizer (tokenizer=True) to find the language token's id")
    except TokenizerError as e:
        raise ConvertError(str(e)) from None
    k = block_size
    if saved is not None and k in (None, saved[0].block_size):  # the exported heads, as they were trained
        k = saved[0].block_size
        head_d_hidden = saved[0].head_d_hidden if head_d_hidden is None else head_d_hidden
    config, state = from_hf(
        folder,
        block_size=k or 1,
        head_d_hidden=head_d_hidden,
        identity_p1=identity_p1,
        tgt_lang_id=tgt_id,
        dropout=dropout,
        unk_id=tok.unk_id() if tok is not None else None,
    )
    if saved is not None and needs_permutation(saved[0]):
        # a native model exported as Pegasus: back to its own architecture and basis, bit for bit
        keep = {"block_size": config.block_size, "identity_p1": identity_p1}
        keep.update({k: v for k, v in (("head_d_hidden", head_d_hidden), ("dropout", dropout)) if v is not None})
        config = BPDConfig.from_dict({**saved[0].to_dict(), **keep})
        state = {k: v for k, v in state.items() if k != "logits_bias"}
        state = permute_model_dim(state, config, torch.argsort(_halves_perm(config.d_model)))
        saved = (saved[0], permute_model_dim(saved[1], saved[0], torch.argsort(_halves_perm(config.d_model))))
    if saved is not None and tgt_id is None and fam == "m2m_100" and saved[0].decoder_prefix:
        # an exported model remembers its target language
        config = BPDConfig.from_dict(
            {**config.to_dict(), "bos_id": saved[0].bos_id, "decoder_prefix": saved[0].decoder_prefix}
        )
    heads_loaded = False
    if saved is not None and saved[0].block_size == config.block_size and config.block_size > 1:
        sc = saved[0]
        if (sc.head_hidden, sc.identity_p1) != (config.head_hidden, config.identity_p1):
            raise ConvertError(
                f"{folder / HEADS_FILE} holds heads with head_d_hidden={sc.head_hidden}, "
                f"identity_p1={sc.identity_p1}; ask for those or for a different k"
            )
        state.update(saved[1])
        heads_loaded = True
    if tok is not None:
        try:
            tok.check_model(config.vocab_size, config.source_vocab_size)
        except TokenizerError as e:
            raise ConvertError(str(e)) from None
    check_buildable(config, state, folder)
    model = BPDModel(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("heads.")]
    if missing or unexpected:
        raise ConvertError(
            f"converted weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.to(map_location).eval()
    meta = {
        "source": "hf",
        "family": fam,
        "folder": str(folder),
        "hub_id": hub_id,
        "architecture": (hf.get("architectures") or [None])[0],
        "heads_loaded": heads_loaded,
        "tokenizer": tok.meta() if tok is not None else None,
    }
    return model, tok, meta


# ----------------------------------------------------------------------------------------------- loading's hf: reader
def claims_hf(folder: Path) -> bool:
    """The encoder-decoder family is asked last and takes every other folder (load_hf refuses what it cannot read)."""
    return True


def read_hf(src, map_location) -> tuple:
    """An `hf:` loading.Source of the encoder-decoder family (its options: src_lang, tgt_lang) -> loading.Read's
    fields (model, tokenizer path, recorded tokenizer hash, meta, tokenizer meta)."""
    model, tok, meta = load_hf(src.path, block_size=None, map_location=map_location, **dict(src.options))
    return model, src.path, None, meta, tok.meta()
