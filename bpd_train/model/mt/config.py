"""Model configuration: a plain dataclass so it round-trips through JSON, checkpoints and Hydra."""

from __future__ import annotations

from dataclasses import dataclass

from bpd_train.model.common import ModelConfig

ACTIVATIONS = ("relu", "gelu", "swish")
POS_LAYOUTS = ("interleaved", "marian", "fairseq")


@dataclass
class BPDConfig(ModelConfig):
    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    max_positions: int = 1024
    block_size: int = 1  # k: number of BPD heads (1 = plain Transformer)
    head_d_hidden: int | None = (
        None  # per-head hidden size of the BPD FFN (paper: d_hidden = d_ff); total k*head_d_hidden
    )
    identity_p1: bool = True  # head 1 is the untouched original path
    head_chain: bool = False  # heads 2..k also see the token before their own (model/heads.py ChainHeads)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 3
    norm_eps: float = 1e-6
    # Architecture options for imported checkpoints (bpd_train/sources/convert/hf/mt.py); the defaults are this
    # project's own models, so older configs and checkpoints load unchanged.
    pre_norm: bool = True  # False: post-norm layers (Marian: x = norm(x + sublayer(x)))
    final_norm: bool = True  # encoder and decoder end with a LayerNorm (False: Marian)
    activation: str = "relu"  # feed-forward activation: relu | gelu | swish
    scale_embedding: bool = True  # token embeddings times sqrt(d_model)
    pos_layout: str = "interleaved"  # sinusoid layout: interleaved (sin/cos alternate) | marian | fairseq
    pos_offset: int = 0  # position p reads row p + pos_offset of the table (M2M100: pad_id + 1)
    share_embeddings: bool = True  # encoder and decoder read one token embedding
    src_vocab_size: int | None = None  # encoder vocabulary when not shared (None: vocab_size)
    tie_output: bool = True  # vocabulary projection = decoder token embedding
    logits_bias: bool = False  # a bias on the vocabulary projection (Marian's final_logits_bias)
    decoder_prefix: tuple[int, ...] = ()  # tokens before bos_id in every target (NLLB/M2M100: decoder start
    #                                       token; bos_id is then the forced target-language code)
    suppress_ids: tuple[int, ...] = ()  # ids the decoders never generate (Marian's bad_words_ids: the pad)
    # the decoder's attention heads and FFN size where they differ from the encoder's (n_heads, d_ff), as
    # transformers allows for Marian / M2M100 / NLLB (None: the same)
    n_decoder_heads: int | None = None
    d_ff_decoder: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        for name, h in (("n_heads", self.n_heads), ("n_decoder_heads", self.decoder_heads)):
            if h <= 0 or self.d_model % h:
                raise ValueError(f"d_model={self.d_model} is not divisible by {name}={h}")
        if self.block_size < 1:
            raise ValueError(f"block_size (k) must be >= 1, got {self.block_size}")
        if self.head_chain and not self.identity_p1:
            raise ValueError("head_chain needs identity_p1: head 1 is the model's own path, the others chain on it")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.pos_layout not in POS_LAYOUTS:
            raise ValueError(f"pos_layout must be one of {', '.join(POS_LAYOUTS)}, got {self.pos_layout!r}")
        if self.pos_offset < 0:
            raise ValueError(f"pos_offset must be >= 0, got {self.pos_offset}")
        # lists from JSON/Hydra become tuples: the config stays hashable and compares equal after a round trip
        self.decoder_prefix = tuple(int(i) for i in self.decoder_prefix)
        self.suppress_ids = tuple(int(i) for i in self.suppress_ids)
        if self.share_embeddings and self.src_vocab_size not in (None, self.vocab_size):
            raise ValueError("src_vocab_size differs from vocab_size, which needs share_embeddings=False")

    @property
    def source_vocab_size(self) -> int:
        return self.src_vocab_size if self.src_vocab_size is not None else self.vocab_size

    @property
    def decoder_heads(self) -> int:
        return self.n_decoder_heads if self.n_decoder_heads is not None else self.n_heads

    @property
    def decoder_ff(self) -> int:
        return self.d_ff_decoder if self.d_ff_decoder is not None else self.d_ff

    @property
    def head_hidden(self) -> int:
        return self.head_d_hidden if self.head_d_hidden is not None else self.d_ff
