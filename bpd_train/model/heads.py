"""BPD heads (Stern et al. 2018, section 6): one feed-forward layer on the final decoder state with hidden
size k*d_hidden and output size k*d_model; every output slice gets a residual connection to the decoder
state. The caller then applies the model's final norm and the shared (tied) vocabulary projection.

With identity_p1 head 1 skips this layer (it is the base model's own path), so the layer only produces
the k-1 future heads. The output projection starts at zero: every head initially equals head 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BPDHeads(nn.Module):
    def __init__(self, d_model: int, k: int, head_hidden: int, identity_p1: bool, dropout: float):
        super().__init__()
        self.k = k
        self.d_model = d_model
        self.identity_p1 = identity_p1
        self.n_out = k - 1 if identity_p1 else k
        self.fc1 = nn.Linear(d_model, k * head_hidden)
        self.fc2 = nn.Linear(k * head_hidden, self.n_out * d_model)
        self.dropout = nn.Dropout(dropout)
        nn.init.xavier_uniform_(self.fc1.weight)
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def slot(self, head: int) -> int:
        """Output slice of head `head` (0-based; 0 = p1)."""
        return head - 1 if self.identity_p1 else head

    def _params(self):
        # plain dict reads: nn.Module attribute lookups cost microseconds, which adds up per decoding step
        fc1, fc2 = self._modules["fc1"]._parameters, self._modules["fc2"]._parameters
        return fc1["weight"], fc1["bias"], fc2["weight"], fc2["bias"]

    def hidden(self, h: Tensor) -> Tensor:
        if self.training or torch.is_grad_enabled():
            return self.dropout(torch.relu(self._modules["fc1"](h)))
        w1, b1, _, _ = self._params()
        return torch.relu(F.linear(h, w1, b1))

    def state(self, h: Tensor, head: int) -> Tensor:
        """h [...,D] -> pre-norm state of one head [...,D]."""
        s = self.slot(head)
        d = self.d_model
        _, _, w2, b2 = self._params()
        return h + F.linear(self.hidden(h), w2[s * d : (s + 1) * d], b2[s * d : (s + 1) * d])

    def states(self, h: Tensor, lo: int, hi: int) -> Tensor:
        """h [...,D] -> pre-norm states of heads lo..hi-1 [...,hi-lo,D] (one matmul for all of them)."""
        s0, s1 = self.slot(lo), self.slot(hi)
        d = self.d_model
        _, _, w2, b2 = self._params()
        if s0 == 0 and s1 == self.n_out:
            out = F.linear(self.hidden(h), w2, b2)
        else:
            out = F.linear(self.hidden(h), w2[s0 * d : s1 * d], b2[s0 * d : s1 * d])
        return h.unsqueeze(-2) + out.view(*h.shape[:-1], s1 - s0, d)


class ChainHeads(nn.Module):
    """Heads that also see the token before their own (Hydra-style sequentially dependent heads; Ankner et al.
    2024, arXiv 2402.05109): head i >= 1 (0-based; it predicts i+1 tokens ahead) reads the decoder state h and the
    embedding e of the token before its target -- head 1's token for head 2, head 2's for head 3, ... (teacher-forced
    in training; while decoding, the previous head's argmax) -- through its own FFN:
        x_i = h + P_i e(prev),  state_i = h + W2_i relu(W1_i x_i + b1_i) + b2_i
    then the model's final norm and shared projection, as BPDHeads. e is the model's own (scaled) token embedding;
    P_i [D,D] and W2_i, b2_i start at zero, so every head initially equals head 1. Head 1 is always the model's own
    path (identity_p1). Parameters are stacked over the k-1 heads: tok [k-1,D,D], w1 [k-1,H,D], b1 [k-1,H],
    w2 [k-1,D,H], b2 [k-1,D]. Measured on the demo: k-hat at k = 4 2.50 (h only) -> 2.98 (docs/experiments.md)."""

    identity_p1 = True
    chained = True

    def __init__(self, d_model: int, k: int, head_hidden: int, dropout: float):
        super().__init__()
        self.k = k
        self.d_model = d_model
        n = k - 1
        self.tok = nn.Parameter(torch.zeros(n, d_model, d_model))  # [heads, out, in]
        self.w1 = nn.Parameter(torch.empty(n, head_hidden, d_model))
        self.b1 = nn.Parameter(torch.zeros(n, head_hidden))
        self.w2 = nn.Parameter(torch.zeros(n, d_model, head_hidden))
        self.b2 = nn.Parameter(torch.zeros(n, d_model))
        self.dropout = nn.Dropout(dropout)
        for w in self.w1:
            nn.init.xavier_uniform_(w)

    def state(self, h: Tensor, head: int, prev: Tensor) -> Tensor:
        """h [...,D], prev [...,D] the embedded token before head `head`'s target -> its pre-norm state [...,D]."""
        if not 1 <= head < self.k:
            raise IndexError(f"chained head {head} out of range 1..{self.k - 1}")
        p = self._parameters
        j = head - 1
        x = h + F.linear(prev, p["tok"][j])
        hid = torch.relu(F.linear(x, p["w1"][j], p["b1"][j]))
        if self.training:
            hid = self.dropout(hid)
        return h + F.linear(hid, p["w2"][j], p["b2"][j])


class MedusaHeads(nn.Module):
    """Medusa heads (Cai et al. 2024, arXiv 2401.10774) for decoder-only models: head i >= 1 (0-based; it
    predicts i+1 tokens ahead) is `n_layers` residual blocks x <- x + SiLU(W x + b) on the *normed* final
    hidden state, followed by the base model's (shared) vocabulary projection -- the layout vLLM's `medusa`
    speculative model runs (bpd_train/export_vllm.py). Head 0 is the base LM head itself.

    The weights of all k-1 heads are stacked ([k-1, layers, D, D]) so one einsum runs every head. Weights and
    biases start at zero: SiLU(0) = 0, so every head initially equals head 1, as with BPDHeads."""

    identity_p1 = True

    def __init__(self, d_model: int, k: int, n_layers: int = 1, dropout: float = 0.0):
        super().__init__()
        self.k = k
        self.d_model = d_model
        self.n_layers = n_layers
        self.weight = nn.Parameter(torch.zeros(k - 1, n_layers, d_model, d_model))  # [heads, layers, out, in]
        self.bias = nn.Parameter(torch.zeros(k - 1, n_layers, d_model))
        self.dropout = nn.Dropout(dropout)

    def states(self, n: Tensor, lo: int, hi: int) -> Tensor:
        """n [...,D] normed hidden state -> states of heads lo..hi-1 (1 <= lo) [...,hi-lo,D], ready for the
        vocabulary projection."""
        if not 1 <= lo < hi <= self.k:
            raise IndexError(f"medusa heads {lo}..{hi - 1} out of range 1..{self.k - 1}")
        x = n.unsqueeze(-2).expand(*n.shape[:-1], hi - lo, n.shape[-1])  # [...,heads,D]
        w, b = self.weight[lo - 1 : hi - 1], self.bias[lo - 1 : hi - 1]
        for layer in range(self.n_layers):
            y = torch.einsum("...hi,hoi->...ho", x, w[:, layer]) + b[:, layer]
            x = x + self.dropout(F.silu(y))
        return x
