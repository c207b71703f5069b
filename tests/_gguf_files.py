"""Small GGUF files for the tests, written with the `gguf` package's writer the way llama.cpp's converter writes
them: a tiny transformers Llama / Qwen2 model (random weights), its q/k rows permuted into llama.cpp's rotary
layout (llama), each tensor in a chosen type, and a byte-level BPE tokenizer with a chat template."""

from __future__ import annotations

import numpy as np
import torch

from _lm_tiny import randomize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = (
    "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. hello world, how are you? "
    "good morning to you 12345 and 678. English and French: le renard brun. "
) * 20


def bpe(vocab_size: int):
    """(tokens in id order, merges as 'a b', token types) of a byte-level BPE trained on TEXT."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    model = json.loads(tk.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, merges, types


def hf_model(
    arch: str,
    vocab: int,
    *,
    d: int = 32,
    d_ff: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv: int = 2,
    tied: bool = False,
    seed: int = 0,
    eos: int = 2,
):
    """A tiny random transformers model with peaked outputs (wide weights, a strong EOS row)."""
    import transformers

    kw = dict(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=d_ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=128,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=eos,
    )
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    cfg = (transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config)(**kw)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    return randomize(model, seed, eos)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    base, leaf = name.rsplit(".", 1)
    if base in _NAMES:
        return f"{_NAMES[base]}.{leaf}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}.{leaf}"


def k_blocks(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    """Raw Q4_K / Q6_K blocks (the gguf package only dequantizes these): random quants, small finite scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (f16) first, then 12 bytes of 6-bit scales, 128 of quants
        raw[..., 0:2] = d
        raw[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    else:  # Q6_K: 128 + 64 bytes of quants, 16 int8 scales, then d (f16)
        raw[..., 192:208] = rng.integers(-20, 20, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = d
    return raw.reshape(rows, -1)


def q4_k_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A Q4_K tensor as gguf dequantizes it: random codes and 6-bit sub-scales / offsets, and per 256 weights its own
    half-precision scale (from 1e-4 to 0.03) and offset scale (2 to 10 times it, as llama.cpp's quantizer gives
    groups around zero; exactly zero in some blocks)."""
    import gguf
    from gguf.quants import dequantize

    qt = gguf.GGMLQuantizationType.Q4_K
    raw = k_blocks(n, k, qt, seed).reshape(n, k // 256, -1)
    rng = np.random.default_rng(seed)
    d = np.exp(rng.uniform(np.log(1e-4), np.log(0.03), size=(n, k // 256, 2)))
    d[..., 1] = d[..., 0] * rng.uniform(2, 10, size=(n, k // 256))
    d[..., 1][rng.random((n, k // 256)) < 0.1] = 0  # no offset in some blocks: every group holds D * code only
    d = d.astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8)
    return torch.from_numpy(dequantize(raw.reshape(n, -1), qt).copy()).view(n, k)


def write_gguf(
    path,
    model,
    tokens,
    merges,
    types,
    *,
    arch: str,
    qtypes: dict | None = None,
    default="F32",
    eos: int = 2,
    bos: int | None = None,
    pre: str = "default",
    chat: bool = True,
    extra=None,
) -> None:
    """The model's tensors in llama.cpp's names and layout; qtypes: gguf name prefix -> type name (first match)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(
        float(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    )
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    if bos is not None:
        w.add_bos_token_id(bos)
    w.add_add_bos_token(bos is not None)
    if chat:
        w.add_chat_template(CHAT)
    for key, value in (extra or {}).items():
        w.add_key_value(key, *value)
    for i, (name, t) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        g = gguf_name(name)
        a = t.detach().float().numpy().copy()
        if arch == "llama" and ".attn_q." in g:
            a = _permute(a, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in g:
            a = _permute(a, c.num_key_value_heads)
        qname = next((q for prefix, q in (qtypes or {}).items() if g.startswith(prefix)), default)
        qtype = gguf.GGMLQuantizationType[qname if a.ndim == 2 else "F32"]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, a)
        elif qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            w.add_tensor(g, k_blocks(a.shape[0], a.shape[1], qtype, seed=i), raw_dtype=qtype)
        else:
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_chat_llama(path) -> None:
    """A tiny llama GGUF file with a byte-level BPE tokenizer and a chat template (make smoke-real's model)."""
    tokens, merges, types = bpe(320)
    eos = tokens.index("<|im_end|>")
    write_gguf(
        path,
        hf_model("llama", len(tokens), eos=eos, seed=0),
        tokens,
        merges,
        types,
        arch="llama",
        eos=eos,
        qtypes={"blk.0": "Q8_0"},
    )


if __name__ == "__main__":  # python tests/_gguf_files.py OUT.gguf
    import sys
    from pathlib import Path

    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    write_tiny_chat_llama(out)
    print(out)
