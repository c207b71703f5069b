"""`gguf:<file>`: llama.cpp's model files -> LMModel, with the `gguf` package, without transformers.

A GGUF file is untrusted input. `check_gguf` reads its header checking every length against the file's size before
it is read (magic, version, counts, every key/value and tensor record, types, dimensions, offsets), so a damaged or
hostile file is refused in one line and nothing is allocated beyond what the file holds; the tensors' bytes stay in
a read-only mapping until `gguf.quants.dequantize` turns each into fp32 (types and block sizes are the gguf
package's too). We decode those fp32 weights exactly; llama.cpp computes on the quantized blocks, so its logits
differ slightly from ours and from transformers'.

What maps where (the names are llama.cpp's, the targets transformers' Llama / Qwen2 layout, which
convert/hf/lm.py turns into LMConfig and our state dict):

  general.architecture            llama (also Mistral and SmolLM files) | qwen2
  <architecture>.embedding_length, .feed_forward_length, .block_count, .context_length, .attention.head_count(_kv),
  .attention.key_length, .rope.freq_base, .rope.scaling.type/factor (linear), .attention.layer_norm_rms_epsilon
  token_embd / output / output_norm / blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate,
  ffn_up, ffn_down}     (llama: q and k rows un-permuted back from llama.cpp's rotary layout)
  tokenizer.ggml.*      a tokenizer.json (byte-level BPE, the `gpt2` model) and tokenizer_config.json (special
                        tokens, chat template), written once per file into a cache folder the loaded model reads
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bpd_train.data.hf_tokenizer import TokenizerError
from bpd_train.data.lm.tokenizer import LMTokenizer
from bpd_train.io import atomic_dir, sha256_file
from bpd_train.model.lm.model import LMModel
from bpd_train.sources.bundle import BundleError, check_buildable
from bpd_train.sources.convert.common import ConvertError
from bpd_train.sources.convert.hf.lm import config_from_hf_lm, state_from_hf_lm

log = logging.getLogger(__name__)

ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY = 65535  # the spec's longest key
MAX_ARRAY_DEPTH = 3  # arrays of arrays: deeper than any real file
# value types of the format (gguf.GGUFValueType): fixed sizes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# how llama.cpp splits text before byte-level BPE, by tokenizer.ggml.pre (the default: GPT-2's regex)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class GGUFError(ConvertError):
    """A GGUF file that cannot be read or imported (one line naming the file)."""


# ------------------------------------------------------------------------------------------------ the header
class _Cursor:
    """Reads little-endian values from the file's bytes, refusing any read past the end."""

    def __init__(self, buf, path: Path):
        self.buf, self.size, self.pos, self.path = buf, len(buf), 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"{self.path}: {what} runs past the end of the file (truncated or damaged: needs "
                f"{n} bytes at offset {self.pos}, the file has {self.size})"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.unpack("Q", what + " length")
        if limit is not None and n > limit:
            raise GGUFError(f"{self.path}: {what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return s

    def text(self, what: str, limit: int | None = None) -> str:
        try:
            return self.string(what, limit).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """One metadata value (a scalar, a string, or a list for an array), its size checked before it is read."""
        if vtype in _FIXED:
            v = self.unpack(_FMT[vtype], what)
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.text(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"{self.path}: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            itype, n = self.unpack("I", what + " item type"), self.unpack("Q", what + " length")
            if itype in _FIXED:
                self.need(n * _FIXED[itype], f"{what} ({n} items)")
                items = np.frombuffer(self.buf, dtype="<" + _FMT[itype].replace("?", "u1"), count=n, offset=self.pos)
                self.pos += n * _FIXED[itype]
                return items.astype(bool).tolist() if itype == 7 else items.tolist()
            if itype not in (_STRING, _ARRAY):
                raise GGUFError(f"{self.path}: {what} has unknown item type {itype}")
            self.need(n * (8 if itype == _STRING else 12), f"{what} ({n} items)")  # the least each item takes
            return [self.value(itype, what, depth + 1) for _ in range(n)]
        raise GGUFError(f"{self.path}: {what} has unknown value type {vtype}")


_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GGUFFile:
    """A checked GGUF file: its metadata (key -> value), its tensors (name -> dims, type, absolute offset, bytes)
    and the read-only mapping their data is read from."""

    def __init__(self, path: Path, data: np.ndarray, header: dict[str, Any]):
        self.path, self.data = path, data
        self.fields: dict[str, Any] = header["fields"]
        start = header["data_offset"]
        self.tensors = {n: (dims, q, start + off, nb) for n, (dims, q, off, nb) in header["tensors"].items()}

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes (a view of the mapping), in the layout gguf.quants.dequantize takes."""
        from gguf import quant_shape_to_byte_shape

        dims, qtype, off, nbytes = self.tensors[name]
        shape = quant_shape_to_byte_shape(tuple(reversed(dims)), qtype)
        return self.data[off : off + nbytes].reshape(shape)


def check_gguf(path: str | os.PathLike) -> GGUFFile:
    """Walk a GGUF file's header against its size; one GGUFError line for anything wrong, nothing allocated
    beyond what the file holds. Returns the checked file (metadata read, tensors located, none read yet)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too short for a GGUF header (truncated?)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return GGUFFile(path, data, _walk(_Cursor(data, path), GGML_QUANT_SIZES, GGMLQuantizationType))


def _walk(c: _Cursor, sizes, qtypes) -> dict[str, Any]:
    path = c.path
    magic = bytes(c.buf[:4])
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    c.pos = 4
    version = c.unpack("I", "version")
    if version not in (2, 3):
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFError(f"{path}: GGUF version {version}{endian} is not supported (versions 2 and 3, little-endian)")
    n_tensors, n_kv = c.unpack("Q", "tensor count"), c.unpack("Q", "metadata count")
    if n_kv * 13 > c.size or n_tensors * 32 > c.size:  # the least one record takes
        raise GGUFError(
            f"{path}: the header claims {n_kv} metadata entries and {n_tensors} tensors, more "
            f"than a {c.size}-byte file can hold"
        )
    alignment, fields = 32, {}
    for i in range(n_kv):
        key = c.text(f"metadata key {i}", MAX_KEY)
        if key in fields:
            raise GGUFError(f"{path}: metadata key {key!r} appears twice")
        vtype = c.unpack("I", f"the type of {key}")
        fields[key] = c.value(vtype, f"metadata {key}")
        if key == "general.alignment":
            alignment = fields[key]
            if vtype != 4 or alignment == 0 or alignment & (alignment - 1):
                raise GGUFError(f"{path}: general.alignment {alignment!r} is not a uint32 power of two")
    tensors: dict[str, tuple] = {}
    for i in range(n_tensors):
        name = c.text(f"tensor name {i}", MAX_KEY)
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        nd = c.unpack("I", f"tensor {name} rank")
        if not 1 <= nd <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {nd} dimensions (1 to {MAX_DIMS})")
        dims = [c.unpack("Q", f"tensor {name} dimensions") for _ in range(nd)]
        raw = c.unpack("I", f"tensor {name} type")
        offset = c.unpack("Q", f"tensor {name} offset")
        try:
            qtype = qtypes(raw)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown type {raw}") from None
        if qtype not in sizes:
            raise GGUFError(f"{path}: tensor {name} has type {qtype.name}, which has no block size")
        block, type_size = sizes[qtype]
        if any(d < 1 or d >= 1 << 40 for d in dims):
            raise GGUFError(f"{path}: tensor {name} has absurd dimensions {dims}")
        n = int(np.prod(dims, dtype=object))
        if dims[0] % block:
            raise GGUFError(
                f"{path}: tensor {name} rows of {dims[0]} values are not whole {qtype.name} blocks of {block}"
            )
        nbytes = n // block * type_size
        if nbytes > c.size:
            raise GGUFError(
                f"{path}: tensor {name} ({dims}, {qtype.name}) needs {nbytes} bytes, more than the "
                f"whole {c.size}-byte file"
            )
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {name} offset {offset} is not aligned to {alignment}")
        tensors[name] = (dims, qtype, offset, nbytes)
    data = -(-c.pos // alignment) * alignment
    for name, (_, _, offset, nbytes) in tensors.items():
        if data + offset + nbytes > c.size:
            raise GGUFError(
                f"{path}: tensor {name} (offset {offset}, {nbytes} bytes) runs past the end of the "
                f"file ({c.size} bytes): truncated or damaged"
            )
    return {"version": version, "alignment": alignment, "data_offset": data, "tensors": tensors, "fields": fields}


# ------------------------------------------------------------------------------------------------ reading
def _field(f: GGUFFile, key: str, default=None):
    return f.get(key, default)


def _require(f: GGUFFile, key: str, kind=int):
    v = f.get(key)
    if v is None:
        raise GGUFError(f"{f.path}: metadata {key} is missing: not a complete model file")
    if isinstance(v, (list, str)) and kind is not str:
        raise GGUFError(f"{f.path}: metadata {key} is {str(v)[:40]!r}, not a {kind.__name__}")
    return kind(v)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return check_gguf(path)


def weight_type(f: GGUFFile) -> str | None:
    """The file's weight type, as llama.cpp's file names give it (e.g. Q4_1 for SmolLM2-135M-Instruct.Q4_1.gguf):
    the type most of its matrices (tensors of 2+ dimensions) have; None for a file without matrices."""
    from collections import Counter

    types = Counter(q.name for dims, q, _, _ in f.tensors.values() if len(dims) > 1)
    return types.most_common(1)[0][0] if types else None


def hf_config_of_gguf(reader: GGUFFile, tensor_names: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) of the transformers model this file holds."""
    path = reader.path
    family = _field(reader, "general.architecture")
    if family not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {family!r} is not supported (bpd-train reads GGUF files of "
            f"{', '.join(ARCHITECTURES)}; Mistral and SmolLM files are llama)"
        )
    cls, model_type = ARCHITECTURES[family]
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{path}: rope_freqs (Llama 3.1-style rope scaling stored as a tensor) is not supported")
    d = _require(reader, f"{family}.embedding_length")
    heads = _require(reader, f"{family}.attention.head_count")
    kv = int(_field(reader, f"{family}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{family}.attention.key_length", d // max(heads, 1)))
    if int(_field(reader, f"{family}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: keys and values of different widths are not supported")
    if int(_field(reader, f"{family}.rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings (rope.dimension_count < head size) are not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(_field(reader, f"{family}.vocab_size", len(tokens)) or 0)
    hf: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": _require(reader, f"{family}.feed_forward_length"),
        "num_hidden_layers": _require(reader, f"{family}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, f"{family}.context_length", 2048)),
        "rope_theta": float(_field(reader, f"{family}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_require(reader, f"{family}.attention.layer_norm_rms_epsilon", float)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    scaling = _field(reader, f"{family}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported (none or linear)")
        hf["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(_require(reader, f"{family}.rope.scaling.factor", float)),
        }
    if family == "llama":
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    else:
        hf.update(use_sliding_window=False, sliding_window=None)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if eos is None:
        raise GGUFError(f"{path}: tokenizer.ggml.eos_token_id is missing: bpd-train needs to know where an answer ends")
    # llama.cpp stops on every end-of-generation token the file names; transformers on eos_token_id only
    stops = [int(eos)] + [
        int(v)
        for k in ("eot", "eom")
        if (v := _field(reader, f"tokenizer.ggml.{k}_token_id")) is not None and int(v) != int(eos)
    ]
    hf.update(bos_token_id=int(bos) if bos is not None else None, eos_token_id=int(eos))
    gen = {"bos_token_id": hf["bos_token_id"], "eos_token_id": stops if len(stops) > 1 else stops[0]}
    return hf, gen


_RENAME = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str | None:
    """llama.cpp's tensor name -> transformers' (None: a name this import does not know)."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in _RENAME:
        return f"{_RENAME[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q / k rows (its converter interleaves each head's two halves)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"{rows} q/k rows do not split into {n_head} heads of rotary pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def state_of_gguf(f: GGUFFile, hf: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Every tensor dequantized to fp32 (gguf.quants.dequantize) under transformers' names; (state, count of
    tensors per type)."""
    from gguf.quants import dequantize

    permuted = hf["model_type"] == "llama"
    out, types = {}, {}
    for gname, (dims, qtype, _, _) in f.tensors.items():
        name = hf_name(gname)
        if name is None:
            raise GGUFError(
                f"{f.path}: tensor {gname} is not part of a {hf['model_type']} model this import knows: "
                "refusing to drop weights silently"
            )
        try:
            w = np.asarray(dequantize(f.raw(gname), qtype), dtype=np.float32)
        except NotImplementedError:
            raise GGUFError(
                f"{f.path}: tensor {gname} has type {qtype.name}, which the gguf package cannot dequantize"
            ) from None
        w = w.reshape(tuple(reversed(dims)))
        if permuted and ".self_attn.q_proj." in name:
            w = _unpermute(w, hf["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in name:
            w = _unpermute(w, hf["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a copy: the mapping is read-only
        types[qtype.name] = types.get(qtype.name, 0) + 1
    return out, types


# ------------------------------------------------------------------------------------------------ tokenizer
def tokenizer_files(reader: GGUFFile) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json (as text) from the file's tokenizer.ggml.* metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    path = reader.path
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2': Llama 3, Qwen2, "
            "SmolLM); for a sentencepiece model convert the original checkpoint and pass it as hf:<folder>"
        )
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens") or []]
    merges = [str(m) for m in _field(reader, "tokenizer.ggml.merges") or []]
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type") or []]
    if not tokens:
        raise GGUFError(f"{path}: the file has no tokenizer.ggml.tokens")
    if types and len(types) != len(tokens):
        raise GGUFError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{path}: merge {m[:40]!r} is not two tokens separated by a space")
        pairs.append((a, b))
    try:
        tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False))
    except Exception as e:
        raise GGUFError(f"{path}: its vocabulary and merges do not make a BPE tokenizer ({e})") from None
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    if pre in _SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        if pre not in ("default", "gpt-2", "gpt2"):
            log.warning("%s: pre-tokenizer %r is not known here; splitting text as GPT-2 does", path, pre)
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    added = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tk.add_special_tokens(specials)
    tk.add_tokens(added)

    def tok(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFError(f"{path}: tokenizer.ggml.{key}_token_id {i} is not a token id (0..{len(tokens) - 1})")
        return tokens[int(i)]

    bos, eos = tok("bos"), tok("eos")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    config: dict[str, Any] = {
        name: t
        for name, t in (
            ("bos_token", bos),
            ("eos_token", eos),
            ("unk_token", tok("unknown")),
            ("pad_token", tok("padding")),
        )
        if t is not None
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return {"tokenizer.json": tk.to_str(), "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True)}


def cache_root() -> Path:
    """Where the tokenizer folders of GGUF files are kept: $BPD_CACHE, else ~/.cache/bpd-train."""
    return Path(os.environ.get("BPD_CACHE") or Path.home() / ".cache" / "bpd-train") / "gguf"


def tokenizer_folder(reader: GGUFFile, file_hash: str) -> Path:
    """The file's tokenizer as a folder (tokenizer.json, tokenizer_config.json), written once per file content."""
    folder = cache_root() / file_hash.removeprefix("sha256:")[:24]
    files = tokenizer_files(reader)
    if folder.is_dir() and all(
        (folder / n).is_file() and (folder / n).read_text(encoding="utf-8") == text for n, text in files.items()
    ):
        return folder
    with atomic_dir(folder, overwrite=True, replaceable=lambda p: set(os.listdir(p)) <= set(files)) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return folder


# ------------------------------------------------------------------------------------------------ loading
def load_gguf(
    path: str | os.PathLike,
    *,
    block_size: int | None = None,
    heads: str | None = None,
    head_d_hidden: int | None = None,
    medusa_layers: int | None = None,
    identity_p1: bool = True,
    tokenizer: bool = True,
    dropout: float | None = None,
    map_location="cpu",
    file_hash: str | None = None,
):
    """`gguf:<file>` -> (LMModel in eval mode, LMTokenizer or None, meta), as load_hf_lm does for a folder: k = 1
    unless block_size asks for fresh, zero-initialised heads (heads: bpd | medusa)."""
    path = Path(path)
    reader = open_gguf(path)
    names = set(reader.tensors)
    try:
        hf, gen = hf_config_of_gguf(reader, names)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConvertError):
            raise
        raise GGUFError(f"{path}: a metadata value has the wrong type ({e})") from None
    if not hf["vocab_size"] and "token_embd.weight" in names:
        hf["vocab_size"] = int(reader.tensors["token_embd.weight"][0][1])
    try:
        config = config_from_hf_lm(
            hf,
            gen,
            block_size=block_size or 1,
            heads=heads or "bpd",
            head_d_hidden=head_d_hidden,
            medusa_layers=medusa_layers or 1,
            identity_p1=identity_p1,
            dropout=dropout,
        )
    except ConvertError as e:
        raise GGUFError(f"{path}: {e}") from None
    state, types = state_of_gguf(reader, hf)
    log.info(
        "%s: %d tensors (%s) dequantized to fp32",
        path.name,
        len(state),
        ", ".join(f"{n} {k}" for k, n in sorted(types.items())),
    )
    try:
        ours = state_from_hf_lm(state, config)
        check_buildable(config, ours, where=f"{path}", optional=("heads.",))
    except (ConvertError, BundleError) as e:
        raise GGUFError(f"{path}: {e}") from None
    tok = None
    if tokenizer:
        try:
            tok = LMTokenizer(tokenizer_folder(reader, file_hash or ("sha256:" + sha256_file(path))))
            tok.check_model(config.vocab_size)
        except TokenizerError as e:
            raise GGUFError(f"{path}: {e}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConvertError):
                raise
            raise GGUFError(f"{path}: the tokenizer metadata has a value of the wrong type ({e})") from None
    model = LMModel(config)
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not m.startswith("heads.")]
    if missing or unexpected:
        raise GGUFError(
            f"{path}: the weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.to(map_location).eval()
    meta = {
        "source": "gguf",
        "family": hf["model_type"],
        "file": str(path.resolve()),
        "architecture": hf["architectures"][0],
        "tensor_types": types,
        "weight_type": weight_type(reader),
        "dequantized": "fp32",
        "heads_loaded": False,
        "tokenizer": tok.meta() if tok is not None else None,
    }
    return model, tok, meta
