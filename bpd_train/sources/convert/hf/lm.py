"""transformers decoder-only checkpoints -> LMModel: LlamaForCausalLM (Llama, SmolLM, TinyLlama, ...),
Qwen2ForCausalLM (Qwen, Qwen2.5) and MistralForCausalLM without a sliding window (Mistral v0.2+: Llama's layers).

Reads the folder itself (config.json, generation_config.json, model.safetensors -- sharded or not -- or
pytorch_model.bin with weights_only=True, via convert/hf/mt.py read_weights); transformers is not needed. What the
import maps:

  config.json                           LMConfig
  hidden_size, intermediate_size        d_model, d_ff
  num_attention_heads, num_key_value_heads, head_dim    n_heads, n_kv_heads, head_dim
  rope_theta (or rope_parameters)       rope_theta, rope_scaling ("linear", "llama3"; other types refused)
  rms_norm_eps, tie_word_embeddings     norm_eps, tie_output
  attention_bias / mlp_bias (Llama)     qkv_bias + o_bias / mlp_bias; Qwen2: q/k/v biases, none on o
  eos_token_id (generation_config first) eos_id; eos_ids when several are listed (the decoders stop on any)

Every tensor of the checkpoint must land somewhere: a name the map does not know is an error, never skipped
(rotary inv_freq buffers that older files store are recomputed and checked instead).

`family_of(folder)` tells the `hf:` resolver (loading.py) whether a folder is one of these (then
`load_hf_lm(folder)` loads it) or not (None: the encoder-decoder import, convert/hf/mt.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bpd_train.data.hf_tokenizer import TokenizerError
from bpd_train.data.lm.tokenizer import LMTokenizer
from bpd_train.model.lm.config import ROPE_SCALING, LMConfig
from bpd_train.model.lm.model import LMModel, rope_frequencies
from bpd_train.sources.bundle import TOKENIZER
from bpd_train.sources.convert.common import (
    HEADS_FORMAT,
    ConvertError,
    check_buildable,
    folder_file,
    is_hf_export,
    read_configs,
    read_heads,
    read_json,
    read_weights,
    resolve,
    write_hf_folder,
)

log = logging.getLogger(__name__)

SUPPORTED_LM = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
_INT_ROPE_KEYS = ("original_max_position_embeddings",)


def family_of(folder_or_config: str | Path | dict[str, Any]) -> str | None:
    """'llama', 'qwen2' or 'mistral' for a supported decoder-only checkpoint folder (or its config.json dict);
    None when it is no decoder-only model (the encoder-decoder import handles it); a ConvertError for an unsupported
    *ForCausalLM architecture."""
    hf = folder_or_config if isinstance(folder_or_config, dict) else read_json(Path(folder_or_config) / "config.json")
    archs = hf.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_LM:
            return SUPPORTED_LM[a]
    if not archs and hf.get("model_type") in SUPPORTED_LM.values():
        return hf["model_type"]
    if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs):  # GPT2LMHeadModel & co
        raise ConvertError(
            f"unsupported decoder-only architecture {', '.join(archs)} (model_type "
            f"{hf.get('model_type')}); bpd-train imports {', '.join(SUPPORTED_LM)}"
        )
    return None


def _rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(rotary base, scaling for LMConfig.rope_scaling); refuses what LMModel does not compute."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "layer_types" not in params:  # transformers >= 5 writes this
        scaling, theta = params, params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        scaling, theta = hf.get("rope_scaling") or {}, hf.get("rope_theta", 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if float((scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConvertError("partial rotary embeddings (partial_rotary_factor < 1) are not implemented")
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ROPE_SCALING:
        raise ConvertError(
            f"rope scaling type {kind!r} is not implemented (bpd-train computes "
            f"{', '.join(['default', *ROPE_SCALING])}); this checkpoint cannot be imported yet"
        )
    out = {"rope_type": kind}
    for key in ROPE_SCALING[kind]:
        value = scaling.get(key, hf.get("max_position_embeddings") if key.startswith("original_max") else None)
        if value is None:
            raise ConvertError(f"rope scaling {kind} lacks {key} in config.json")
        out[key] = float(value)
    return float(theta), out


def _eos(hf: dict[str, Any], gen: dict[str, Any]) -> tuple[int, list[int] | None]:
    """(eos_id, eos_ids): what ends generation, as transformers' generate reads it (generation_config.json's
    eos_token_id, else config.json's; either may be a list). eos_id, the id data and exports write, is config.json's
    own when it is one of the list (Llama 3 instruct: <|eot_id|>, the end of a turn), else the list's first."""
    v = gen.get("eos_token_id", hf.get("eos_token_id"))
    ids = [int(i) for i in v] if isinstance(v, (list, tuple)) else [int(v)] if v is not None else []
    if not ids:
        raise ConvertError("neither generation_config.json nor config.json gives an eos_token_id")
    own = hf.get("eos_token_id")
    first = int(own) if isinstance(own, int) and int(own) in ids else ids[0]
    return first, (ids if len(set(ids)) > 1 else None)


def _head_dim(hf: dict[str, Any]) -> int | None:
    """head_dim when it is not hidden_size / heads (None: the default, so configs compare equal either way)."""
    d = hf.get("head_dim")
    if not d or int(d) * int(hf["num_attention_heads"]) == int(hf["hidden_size"]):
        return None
    return int(d)


def config_from_hf_lm(
    hf: dict[str, Any],
    generation: dict[str, Any] | None = None,
    *,
    block_size: int = 1,
    heads: str = "bpd",
    head_d_hidden: int | None = None,
    medusa_layers: int = 1,
    identity_p1: bool = True,
    dropout: float | None = None,
) -> LMConfig:
    """The LMConfig that computes what transformers computes for this config.json."""
    fam = family_of(hf)
    if fam is None:
        raise ConvertError(
            f"{', '.join(hf.get('architectures') or ['this model'])} is not a decoder-only LM; "
            f"bpd-train imports {', '.join(SUPPORTED_LM)} here"
        )
    gen = generation or {}
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"hidden_act {act!r} is not supported (Llama/Qwen2 SwiGLU uses silu)")
    if fam == "qwen2" and (hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or [])):
        raise ConvertError("sliding-window attention (use_sliding_window) is not implemented")
    window = hf.get("sliding_window") if fam == "mistral" else None
    if window is not None:  # even one as long as the context: generation runs past it, where transformers masks
        raise ConvertError(
            f"sliding-window attention (sliding_window={window}) is not implemented: bpd-train "
            "attends to the whole sequence, so tokens past the window would differ from transformers "
            "(Mistral v0.2 and later have sliding_window null)"
        )
    if hf.get("pretraining_tp", 1) not in (1, None):
        log.info("pretraining_tp=%s only changes how transformers splits its matmuls; ignored", hf["pretraining_tp"])
    bias = bool(hf.get("attention_bias", False)) if fam == "llama" else False
    try:
        theta, scaling = _rope(hf)
        eos = _eos(hf, gen)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConvertError):
            raise
        raise ConvertError(f"config.json holds a value of the wrong type ({e})") from None
    bos = gen.get("bos_token_id", hf.get("bos_token_id"))
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    try:
        return LMConfig(
            vocab_size=int(hf["vocab_size"]),
            d_model=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=int(hf["num_attention_heads"]),
            n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=_head_dim(hf),
            d_ff=int(hf["intermediate_size"]),
            max_positions=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_output=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if fam == "qwen2" else bias,
            o_bias=False if fam == "qwen2" else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if fam == "llama" else False,  # Mistral: no biases at all
            dropout=float(hf.get("attention_dropout", 0.0) if dropout is None else dropout),
            block_size=int(block_size),
            heads=heads,
            head_d_hidden=head_d_hidden,
            medusa_layers=int(medusa_layers),
            identity_p1=identity_p1,
            bos_id=int(bos) if bos is not None else None,
            eos_id=eos[0],
            eos_ids=eos[1],
        )
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]!r}: not a complete {fam} config") from None
    except (TypeError, ValueError) as e:
        raise ConvertError(f"config.json describes a model bpd-train cannot build: {e}") from None


def _name_map(c: LMConfig) -> list[tuple[str, list[str]]]:
    """(our name, [HF names concatenated on dim 0]) for every backbone tensor but the embeddings."""
    pairs = [("norm.weight", ["model.norm.weight"])]
    for i in range(c.n_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        pairs += [
            (f"{ours}.norm1.weight", [f"{hf}.input_layernorm.weight"]),
            (f"{ours}.norm2.weight", [f"{hf}.post_attention_layernorm.weight"]),
            (f"{ours}.attn.qkv.weight", [f"{hf}.self_attn.{p}_proj.weight" for p in "qkv"]),
            (f"{ours}.attn.o.weight", [f"{hf}.self_attn.o_proj.weight"]),
            (f"{ours}.mlp.gate_up.weight", [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"]),
            (f"{ours}.mlp.down.weight", [f"{hf}.mlp.down_proj.weight"]),
        ]
        if c.qkv_bias:
            pairs.append((f"{ours}.attn.qkv.bias", [f"{hf}.self_attn.{p}_proj.bias" for p in "qkv"]))
        if c.o_bias:
            pairs.append((f"{ours}.attn.o.bias", [f"{hf}.self_attn.o_proj.bias"]))
        if c.mlp_bias:
            pairs += [
                (f"{ours}.mlp.gate_up.bias", [f"{hf}.mlp.gate_proj.bias", f"{hf}.mlp.up_proj.bias"]),
                (f"{ours}.mlp.down.bias", [f"{hf}.mlp.down_proj.bias"]),
            ]
    return pairs


def state_from_hf_lm(sd: dict[str, Tensor], c: LMConfig) -> dict[str, Tensor]:
    """HF tensors -> our backbone state dict. Every HF tensor is used (or is a recomputable buffer)."""
    if not any(k.startswith("model.") for k in sd):  # saved from the bare LlamaModel / Qwen2Model
        sd = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in sd.items()}
    used: set[str] = set()

    def get(name: str) -> Tensor:
        if name not in sd:
            raise ConvertError(f"the checkpoint lacks {name}: not a complete checkpoint of this config")
        used.add(name)
        return sd[name]

    out = {
        ours: torch.cat([get(t) for t in theirs]) if len(theirs) > 1 else get(theirs[0])
        for ours, theirs in _name_map(c)
    }
    out["embed.weight"] = get("model.embed_tokens.weight")
    if not c.tie_output:
        out["lm_head.weight"] = get("lm_head.weight")
    elif "lm_head.weight" in sd:  # some tied checkpoints store the projection anyway: it must be the embedding
        if not torch.equal(sd["lm_head.weight"], out["embed.weight"]):
            raise ConvertError("tie_word_embeddings is true but lm_head.weight differs from the token embedding")
        used.add("lm_head.weight")
    for name in [n for n in sd if n.endswith("rotary_emb.inv_freq")]:
        dh = c.dh
        ours = rope_frequencies(dh, c.rope_theta, c.rope_scaling)
        if sd[name].shape != ours.shape or not torch.allclose(sd[name].float(), ours, rtol=1e-5):
            raise ConvertError(f"{name} is not the plain rotary table of rope_theta={c.rope_theta}")
        used.add(name)
    unknown = sorted(set(sd) - used)
    if unknown:
        raise ConvertError(
            f"the checkpoint holds {len(unknown)} tensor(s) this import does not know, e.g. "
            f"{unknown[0]}: refusing to drop weights silently"
        )
    v = out["embed.weight"].shape[0]
    if v != c.vocab_size:
        raise ConvertError(f"config.json says vocab_size {c.vocab_size} but the embedding has {v} rows")
    return {k: t.contiguous() for k, t in out.items()}


def from_hf_lm(folder: str | Path, **config_kw) -> tuple[LMConfig, dict[str, Tensor]]:
    """A checkpoint folder -> (LMConfig, backbone state dict). Heads are not read here."""
    hf, gen = read_configs(Path(folder))
    config = config_from_hf_lm(hf, gen, **config_kw)  # refuses before reading gigabytes
    return config, state_from_hf_lm(read_weights(folder), config)


# ------------------------------------------------------------------------------------------ ours -> HF
def hf_config_of_lm(c: LMConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) of the transformers model that computes what ours does: Qwen2
    when only q/k/v carry biases, else Llama."""
    qwen = c.qkv_bias and not c.o_bias and not c.mlp_bias
    if not qwen and c.qkv_bias != c.o_bias:
        raise ConvertError(
            "q/k/v biases without an output bias are Qwen2's layout, which has no MLP biases; "
            "this combination has no transformers equivalent"
        )
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:  # a context length is an integer in transformers' config (a float warns)
        rope.update(
            {k: int(v) if k in _INT_ROPE_KEYS and float(v).is_integer() else v for k, v in c.rope_scaling.items()}
        )
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.dh,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_positions,
        "rms_norm_eps": c.norm_eps,
        "rope_parameters": rope,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_output,
        "attention_dropout": 0.0,
        "bos_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
        "pad_token_id": None,
        "use_cache": True,
    }
    if qwen:
        cfg.update(use_sliding_window=False, sliding_window=None)
    else:
        cfg.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    gen = {"bos_token_id": c.bos_id, "eos_token_id": list(c.eos_ids) if c.eos_ids else c.eos_id, "do_sample": False}
    return cfg, gen


def state_to_hf_lm(model) -> dict[str, Tensor]:
    """Our backbone -> transformers tensor names (the fused q/k/v and gate/up split back)."""
    c = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if not k.startswith("heads.")}
    out: dict[str, Tensor] = {}
    split = {"qkv": [c.n_heads * c.dh, c.kv_heads * c.dh, c.kv_heads * c.dh], "gate_up": [c.d_ff, c.d_ff]}
    for ours, theirs in _name_map(c):
        sizes = split[ours.split(".")[-2]] if len(theirs) > 1 else [sd[ours].shape[0]]
        for name, part in zip(theirs, sd[ours].split(sizes, dim=0)):
            out[name] = part
    out["model.embed_tokens.weight"] = sd["embed.weight"]
    if not c.tie_output:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.clone().contiguous() for k, v in out.items()}


def to_hf_lm(
    model,
    out_dir: str | Path,
    tokenizer_folder: str | Path | None = None,
    overwrite: bool = False,
    files: dict[str, str | Path] | None = None,
) -> Path:
    """Write an LMModel as a transformers checkpoint folder (config.json, generation_config.json,
    model.safetensors), its heads in bpd_heads.safetensors (LMConfig in the metadata; load_hf_lm reads them
    back), and the tokenizer files of tokenizer_folder (or `files`: name in the folder -> file to copy, e.g. the
    sentencepiece tokenizer.model of a model trained here from scratch). Atomic: complete or absent."""
    if model.config.heads == "chain" and model.config.block_size > 1:
        raise ConvertError(
            "chained heads (model.heads=chain) have no transformers heads-file format; export this model as a "
            "bundle (export.format=bundle), which keeps them"
        )
    cfg, gen = hf_config_of_lm(model.config)
    heads = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items() if k.startswith("heads.")}
    meta = {"format": HEADS_FORMAT, "version": "1", "lm_config": json.dumps(model.config.to_dict(), sort_keys=True)}
    copies: dict[str, Path] = {}
    if tokenizer_folder is not None:
        copies = {name: Path(tokenizer_folder) / name for name in LMTokenizer(tokenizer_folder).files()}
    copies.update({name: Path(src) for name, src in (files or {}).items()})
    return write_hf_folder(
        out_dir, cfg, gen, state_to_hf_lm(model), heads or None, meta, copies, overwrite, replaceable=is_hf_export
    )


def load_hf_lm(
    folder_or_id: str | Path,
    *,
    block_size: int | None = None,
    heads: str | None = None,
    head_d_hidden: int | None = None,
    medusa_layers: int | None = None,
    identity_p1: bool = True,
    tokenizer: bool = True,
    dropout: float | None = None,
    map_location="cpu",
):
    """`hf:<folder or hub id>` of a Llama/Qwen2/Mistral model -> (LMModel in eval mode, LMTokenizer or None, meta).
    block_size None: the heads saved beside the checkpoint (bpd_heads.safetensors, as to_hf_lm writes them) are
    loaded with their k and type, else k = 1. Any other k (or head type) adds fresh, zero-initialised heads
    (heads: bpd | medusa, default bpd)."""
    folder, hub_id = resolve(folder_or_id)
    hf = read_json(folder / "config.json")
    fam = family_of(hf)
    if fam is None:
        raise ConvertError(f"{folder} is not a decoder-only model bpd-train imports ({', '.join(SUPPORTED_LM)})")
    tok = None
    saved = read_heads(folder, "lm_config", LMConfig)
    sc = saved[0] if saved is not None else None
    same = (
        sc is not None
        and block_size in (None, sc.block_size)
        and heads in (None, sc.heads)
        and head_d_hidden in (None, sc.head_d_hidden)
        and medusa_layers in (None, sc.medusa_layers)
        and identity_p1 == sc.identity_p1
    )
    if same:  # the exported heads, as they were trained
        block_size, heads, head_d_hidden, medusa_layers = sc.block_size, sc.heads, sc.head_d_hidden, sc.medusa_layers
    config, state = from_hf_lm(
        folder,
        block_size=block_size or 1,
        heads=heads or "bpd",
        head_d_hidden=head_d_hidden,
        medusa_layers=medusa_layers or 1,
        identity_p1=identity_p1,
        dropout=dropout,
    )
    if same and config.block_size > 1:
        state.update(saved[1])
    if tokenizer:
        try:
            tok = LMTokenizer(folder)
            tok.check_model(config.vocab_size)
        except TokenizerError as e:
            raise ConvertError(str(e)) from None
    check_buildable(config, state, folder)
    model = LMModel(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not (same and config.block_size > 1):  # fresh heads keep their zero initialisation
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
        "heads_loaded": bool(same and config.block_size > 1),
        "tokenizer": tok.meta() if tok is not None else None,
    }
    return model, tok, meta


# ----------------------------------------------------------------------------------------------- loading's hf: reader
def claims_hf(folder: Path) -> bool:
    """Whether an `hf:` folder holds a checkpoint of the decoder-only family (Llama / Qwen2 / Mistral)."""
    return family_of(folder) is not None


def read_hf(src, map_location) -> tuple:
    """An `hf:` loading.Source of the decoder-only family -> loading.Read's fields (model, tokenizer path, recorded
    tokenizer hash, meta, tokenizer meta)."""
    if src.options:
        raise ConvertError(f"{src.given}: a decoder-only model takes no @<src_lang>:<tgt_lang>")
    if not (src.path / "tokenizer.json").is_file() and (src.path / TOKENIZER).is_file():
        # exported by export.format=hf from a model trained here from scratch: the corpus's sentencepiece model
        tok = folder_file(src.path, TOKENIZER)
        model, _, meta = load_hf_lm(src.path, block_size=None, map_location=map_location, tokenizer=False)
        return model, tok, None, meta, None
    model, tok, meta = load_hf_lm(src.path, block_size=None, map_location=map_location)
    return model, src.path, None, meta, tok.meta()
