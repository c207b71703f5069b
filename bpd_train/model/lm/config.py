"""Configuration of the decoder-only family (bpd_train/model/lm/model.py): a plain dataclass, like BPDConfig.

A separate dataclass rather than BPDConfig with an `arch` switch: almost none of BPDConfig's fields mean
anything here (encoder layers, cross-attention, sinusoid layouts, decoder prefix) and the Llama fields mean
nothing there (key/value heads, rotary base, RMSNorm, SwiGLU, attention biases). One class per family keeps
every field meaningful. `arch = "lm"` is stored in `to_dict()`, so a saved config says which family it
builds (`bpd_train.model.config_from_dict` dispatches on it; BPDConfig has no such key).
"""

from __future__ import annotations

from dataclasses import dataclass

from bpd_train.model.common import ModelConfig

HEAD_TYPES = ("bpd", "medusa", "chain")
ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class LMConfig(ModelConfig):
    vocab_size: int
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads (None: n_heads)
    head_dim: int | None = None  # per-head size (None: d_model // n_heads; some checkpoints set it)
    d_ff: int = 1408  # SwiGLU hidden size
    max_positions: int = 2048  # context length: the longest prompt the decoders accept
    rope_theta: float = 10000.0
    # None: plain rotary positions; {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} as transformers defines them
    rope_scaling: dict | None = None
    norm_eps: float = 1e-6
    tie_output: bool = True  # vocabulary projection = token embedding
    qkv_bias: bool = False  # Qwen2: biases on q/k/v; Llama attention_bias: on q/k/v and o
    o_bias: bool = False
    mlp_bias: bool = False
    dropout: float = 0.0
    block_size: int = 1  # k: number of heads (1 = plain LM)
    heads: str = "bpd"  # bpd: the paper's FFN heads | medusa: a residual SiLU block per head | chain: FFN heads that
    # also read the token before their own (Hydra-style; model/heads.py ChainHeads)
    head_d_hidden: int | None = None  # bpd heads: per-head hidden size (None: d_ff)
    medusa_layers: int = 1  # medusa heads: residual blocks per head (vLLM's num_hidden_layers)
    identity_p1: bool = True  # head 1 is the base LM head (always so for medusa)
    # pad_id is a sentinel, not a vocabulary id: prompts batched for the decoders are right-padded with it, so
    # no real token (an instruct model's <|im_end|> inside a chat, say) is ever mistaken for padding
    pad_id: int = -1
    bos_id: int | None = None  # the tokenizer's BOS, prepended to prompts by the data side; decoders
    #                                   start from each prompt's last token, never from BOS
    eos_id: int = 2
    # every id that ends generation where a checkpoint lists several (generation_config.json's eos_token_id list:
    # Llama 3 / Qwen2 instruct end a turn with <|eot_id|> / <|im_end|>, text with another); eos_id is one of
    # them. None: eos_id alone. The decoders stop on any (decoding/common.py stop_ids).
    eos_ids: list[int] | None = None
    arch: str = "lm"

    def __post_init__(self) -> None:
        if self.arch != "lm":
            raise ValueError(f"LMConfig.arch must be 'lm', got {self.arch!r}")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}")
        if self.dh % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.dh}")
        if self.block_size < 1:
            raise ValueError(f"block_size (k) must be >= 1, got {self.block_size}")
        if self.heads not in HEAD_TYPES:
            raise ValueError(f"heads must be one of {', '.join(HEAD_TYPES)}, got {self.heads!r}")
        if self.heads in ("medusa", "chain") and not self.identity_p1:
            raise ValueError(f"{self.heads} heads keep head 1 as the base LM head: identity_p1 must be true")
        if self.medusa_layers < 1:
            raise ValueError(f"medusa_layers must be >= 1, got {self.medusa_layers}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            need = ROPE_SCALING.get(kind)
            if need is None:
                raise ValueError(f"rope_scaling rope_type must be one of {', '.join(ROPE_SCALING)}, got {kind!r}")
            lacking = [k for k in need if k not in self.rope_scaling]
            if lacking:
                raise ValueError(f"rope_scaling of type {kind} needs {', '.join(lacking)}")
            self.rope_scaling = {"rope_type": kind, **{k: float(self.rope_scaling[k]) for k in need}}
        if self.eos_ids is not None:
            ids = list(dict.fromkeys(int(i) for i in self.eos_ids))
            if self.eos_id not in ids:
                raise ValueError(f"eos_ids {ids} must include eos_id {self.eos_id}")
            if any(not 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"eos_ids {ids} hold ids outside the vocabulary (size {self.vocab_size})")
            self.eos_ids = ids if len(ids) > 1 else None
        if self.pad_id >= 0:
            raise ValueError(
                f"pad_id of a decoder-only model is a negative sentinel (not a token id), got {self.pad_id}"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def dh(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def head_hidden(self) -> int:
        return self.head_d_hidden if self.head_d_hidden is not None else self.d_ff
