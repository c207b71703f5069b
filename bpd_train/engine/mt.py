"""The weights one decode step of the encoder-decoder BPDModel reads, prepared once per weight version:
`DecodeWeights`, that family's `DecodeStep` (engine/step.py; engine/lm.py is the decoder-only one; engine/packed.py
what both share: `DecodeOptions`, the draft projection, the weight cache).

Every decoder (greedy, beam search, blockwise) runs its decoder calls, vocabulary projections and BPD heads
through the same DecodeWeights, so they share one arithmetic path (engine/fastlinear.py) and exact blockwise
decoding reproduces greedy decoding of the same precision. A decoder's packed-weight cache (engine/weights.py
PackedWeights) builds and keeps it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bpd_train.engine.fastlinear import PackedLinear
from bpd_train.engine.packed import DecodeOptions, copy_rows, draft_projection, verify_groups
from bpd_train.engine.step import DecodeStep, cache_start, python_greedy_steps


class StepWeights(NamedTuple):
    """One decoder layer's tensors and packed linears for decode_step."""

    n_heads: int
    shape: tuple
    eps: float
    n1_w: Tensor
    n1_b: Tensor
    qkv: PackedLinear
    so: PackedLinear
    n2_w: Tensor
    n2_b: Tensor
    q: PackedLinear
    co: PackedLinear
    n3_w: Tensor
    n3_b: Tensor
    f1: PackedLinear
    f2: PackedLinear
    pre_norm: bool = True  # False: post-norm (imported Marian models); see layers.decode_step
    act: Callable[[Tensor], Tensor] = torch.relu


def _lin(mod: nn.Linear, dtype: str) -> PackedLinear:
    p = mod._parameters
    return PackedLinear(p["weight"], p["bias"], dtype)


class DecodeWeights(DecodeStep):
    """Decode-step weights of one BPDModel (see the module docstring; the DecodeStep of engine/step.py). h below is
    the decoder output [...,D] before the final norm."""

    multi_stop = False  # one eos id ends a row

    # cache rows copied in one native call where the kernels are loaded (model/cache.py DecoderState.reorder)
    copy_rows = staticmethod(copy_rows)

    def __init__(self, model: nn.Module, options: DecodeOptions):
        if options.tree:
            raise ValueError("tree: candidate trees are for decoder-only models; leave decode.tree empty here")
        self.options = options
        dt = options.dtype
        self.layers: list[StepWeights] = []
        for layer in model.decoder_layers:
            m = layer._modules
            sa, ca, ffn = m["self_attn"]._modules, m["cross_attn"]._modules, m["ffn"]._modules
            n1, n2, n3 = (m[k]._parameters for k in ("norm1", "norm2", "norm3"))
            self.layers.append(
                StepWeights(
                    layer.self_attn.n_heads,
                    m["norm1"].normalized_shape,
                    m["norm1"].eps,
                    n1["weight"],
                    n1["bias"],
                    _lin(sa["qkv"], dt),
                    _lin(sa["out"], dt),
                    n2["weight"],
                    n2["bias"],
                    _lin(ca["q"], dt),
                    _lin(ca["out"], dt),
                    n3["weight"],
                    n3["bias"],
                    _lin(ffn["fc1"], dt),
                    _lin(ffn["fc2"], dt),
                    layer.pre_norm,
                    layer.ffn.act,
                )
            )
        # the native step runs all layers in one C++ call where every linear is on the native kernels (it
        # implements the pre-norm ReLU layer only; imported post-norm / gelu / swish layers run in Python)
        self.ext = self.layers[0].qkv.native if self.layers else None
        self.native_layers = None
        if (
            self.ext is not None
            and all(lin.lin is not None for w in self.layers for lin in (w.qkv, w.so, w.q, w.co, w.f1, w.f2))
            and all(w.pre_norm and w.act is torch.relu for w in self.layers)
        ):
            self.native_layers = [
                self.ext.StepLayer(
                    w.n_heads,
                    w.eps,
                    w.n1_w,
                    w.n1_b,
                    w.qkv.lin,
                    w.so.lin,
                    w.n2_w,
                    w.n2_b,
                    w.q.lin,
                    w.co.lin,
                    w.n3_w,
                    w.n3_b,
                    w.f1.lin,
                    w.f2.lin,
                )
                for w in self.layers
            ]
        self.native_encoder = self._native_encoder(model) if self.native_layers is not None else None
        norm = model.decoder_norm
        self.norm = (norm.normalized_shape, norm.weight, norm.bias, norm.eps) if norm is not None else None
        emb = model.output_weight()
        self.vocab_size = emb.shape[0]
        bias = model.decode_logits_bias()
        self.proj = PackedLinear(emb, bias, dt, screen=True)
        heads = model._modules.get("heads")
        self.k = model.config.block_size
        self.d = model.config.d_model
        self.identity_p1 = heads is None or heads.identity_p1
        # heads 2..k and the projection they propose through (never the output: head 1 verifies in dt)
        self.pdt = (options.proposal_dtype or dt) if self.identity_p1 else dt
        self.heads = heads
        self._slots: dict[tuple[int, int], tuple[PackedLinear, PackedLinear]] = {}
        self.stats: dict = {}  # decoders' statistics about these weights (e.g. heads' acceptance rates)
        self.last_seconds: float | None = None  # time of the last native loop call (greedy_steps / block_steps)
        self.draft_ids, self.draft_proj = draft_projection(emb, bias, options.draft_vocab, self.pdt)
        # the projection proposals are made with: the draft's, else head 1's own unless proposals have their
        # own precision
        self.prop_proj = self.draft_proj or (
            self.proj if self.pdt == dt or heads is None else PackedLinear(emb, bias, self.pdt)
        )
        # chained heads (model/heads.py ChainHeads): per head 2..k its token map, FFN in and out, in the proposal
        # precision, and the token embedding they read (self.chain: the same for the native kernels)
        self.chained = bool(getattr(heads, "chained", False))
        self.chain = None
        if self.chained:
            hp = heads._parameters
            self._chain_lins = [
                (
                    PackedLinear(hp["tok"][j], None, self.pdt),
                    PackedLinear(hp["w1"][j], hp["b1"][j], self.pdt),
                    PackedLinear(hp["w2"][j], hp["b2"][j], self.pdt),
                )
                for j in range(self.k - 1)
            ]
            self._chain_emb = (model._modules["embed"]._parameters["weight"].detach(), float(model.embed_scale))
            if self.ext is not None and all(lin.lin is not None for lins in self._chain_lins for lin in lins):
                self.chain = self.ext.ChainProp(
                    [t.lin for t, _, _ in self._chain_lins],
                    [f1.lin for _, f1, _ in self._chain_lins],
                    [f2.lin for _, _, f2 in self._chain_lins],
                    self._chain_emb[0].float().contiguous(),
                    self._chain_emb[1],
                )

        # head 1's positions per pass of the lazy verification, batch 1 / batch > 1 (None: verify_groups decides)
        self.verify_group: int | None = None
        self.batch_verify_group: int | None = None
        # greedy steps as one native call (greedy_steps): needs the native layers and head-1 argmax
        self.native_loop = None
        if self.native_layers is not None and self.identity_p1 and self.norm is not None and self.proj.lin is not None:
            emb_w = self._emb_w = model._modules["embed"]._parameters["weight"]
            _, nw, nb, eps = self.norm
            ext, scale, proj = self.ext, float(model.embed_scale), self.proj.lin
            self._emb_scale = scale

            def native_loop(
                tok, pe, max_pos, layers, self_kv, mem_kv, mem_mask, g, t, lengths, room, n, eos, to_end=False, smp=None
            ):
                return ext.greedy_steps(
                    tok,
                    emb_w,
                    scale,
                    pe,
                    max_pos,
                    layers,
                    self_kv,
                    mem_kv,
                    mem_mask,
                    g,
                    t,
                    lengths,
                    nw,
                    nb,
                    eps,
                    proj,
                    eos,
                    room,
                    n,
                    to_end,
                    *(smp or (None, None)),
                )

            self.native_loop = native_loop

    def _native_encoder(self, model: nn.Module):
        """The encoder's layers (fp32, whatever the decode dtype: the torch encoder was fp32 too), its final norm and
        the decoder layers' cross-attention key/value projections on the native kernels, or None where a layer is
        not the pre-norm ReLU layer they implement."""
        ext, layers = self.ext, []
        for layer in model.encoder_layers:
            m = layer._modules
            if not (layer.pre_norm and layer.ffn.act is torch.relu):
                return None
            at, ffn = m["attn"]._modules, m["ffn"]._modules
            lins = [_lin(mod, "fp32") for mod in (at["qkv"], at["out"], ffn["fc1"], ffn["fc2"])]
            if any(lin.lin is None for lin in lins):
                return None
            n1, n2 = m["norm1"], m["norm2"]
            layers.append(
                ext.EncLayer(
                    layer.attn.n_heads,
                    n1.eps,
                    n1.weight,
                    n1.bias,
                    lins[0].lin,
                    lins[1].lin,
                    n2.weight,
                    n2.bias,
                    lins[2].lin,
                    lins[3].lin,
                )
            )
        kv = [_lin(layer._modules["cross_attn"]._modules["kv"], "fp32") for layer in model.decoder_layers]
        if any(lin.lin is None for lin in kv):
            return None
        norm = model.encoder_norm
        return (
            layers,
            (norm.weight, norm.bias, norm.eps) if norm is not None else (None, None, 0.0),
            [lin.lin for lin in kv],
            model.decoder_layers[0].cross_attn.n_heads,
        )

    def encode_ids(self, model: nn.Module, src: Tensor) -> tuple[Tensor, bool]:
        """The encoder stack on the native kernels (BPDModel.encode at inference): src [B,S] ids, right-padded
        with pad_id -> ([B,S,d] after the final norm, whether any row is padded). The embedding (as
        BPDModel._embed rounds it) and the padding mask are computed there too."""
        layers, (nw, nb, eps), _, _ = self.native_encoder
        table = model.src_embed if model.src_embed is not None else model.embed
        return self.ext.encode_ids(
            src,
            table._parameters["weight"],
            float(model.embed_scale),
            model.pe,
            int(model.config.pad_id),
            layers,
            nw,
            nb,
            eps,
        )

    def memory_kv(self, out: Tensor) -> Tensor:
        """Every decoder layer's cross-attention keys and values of the encoder output out [B,S,d] -> [L,2,B,H,S,Dh]."""
        _, _, kv, heads = self.native_encoder
        return self.ext.memory_kv(out, kv, heads)

    # ---- the pieces of a step ----
    def final_norm(self, h: Tensor) -> Tensor:
        if self.norm is None:  # models without a final norm (Marian)
            return h
        shape, w, b, eps = self.norm
        if self.proj.lin is not None and h.dtype == torch.float32:
            # the native loops' own layer norm: full logits (other acceptance rules, beam search) then round
            # exactly as head1_argmax's, so TopK(1) stays Exact
            return self.ext.layer_norm(h, w, b, eps)
        return torch.layer_norm(h, shape, w, b, eps)

    def _head_ffn(self, lo: int, hi: int) -> tuple[PackedLinear, PackedLinear]:
        """fc1 and the rows of fc2 that produce heads lo..hi-1 (packed once per range)."""
        key = (lo, hi)
        got = self._slots.get(key)
        if got is None:
            hd = self.heads
            s0, s1, d = hd.slot(lo), hd.slot(hi), self.d
            fc1, fc2 = hd.fc1._parameters, hd.fc2._parameters
            dt = self.pdt
            got = self._slots[key] = (
                PackedLinear(fc1["weight"], fc1["bias"], dt),
                PackedLinear(fc2["weight"][s0 * d : s1 * d], fc2["bias"][s0 * d : s1 * d], dt),
            )
        return got

    def _chain_states(self, h: Tensor, lo: int, hi: int, first: Tensor | None):
        """Chained heads lo..hi-1 (lo >= 1), one after another: h [...,D], first [...] the token before head lo's
        target (None: the model's own chain from head 1's argmax) -> (pre-norm states [...,hi-lo,D], their proposals
        [...,hi-lo]); each head reads the previous one's proposal."""
        if first is None:
            first = self.head1_argmax(h) if lo == 1 else self._chain_states(h, 1, lo, None)[1][..., -1]
        emb, scale = self._chain_emb
        prev, states, ids = first, [], []
        for i in range(lo, hi):
            t, f1, f2 = self._chain_lins[i - 1]
            x = h + t(F.embedding(prev, emb) * scale)
            st = h + f2(torch.relu(f1(x)))
            s = self.final_norm(st)
            prev = self.prop_proj(s).argmax(-1)
            if self.draft_proj is not None:
                prev = self.draft_ids[prev]
            states.append(st)
            ids.append(prev)
        return torch.stack(states, dim=-2), torch.stack(ids, dim=-1)

    def states(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """h [...,D] -> pre-norm states of heads lo..hi-1 [...,hi-lo,D] (chained heads: each given the previous
        head's proposal; first: the token before head lo's target, see propose)."""
        parts = []
        if lo == 0 and self.identity_p1:
            parts.append(h.unsqueeze(-2))
            lo = 1
        if lo < hi and self.chained:
            parts.append(self._chain_states(h, lo, hi, first if not parts else None)[0])
        elif lo < hi:
            f1, f2 = self._head_ffn(lo, hi)
            out = f2(torch.relu(f1(h)))
            parts.append(h.unsqueeze(-2) + out.view(*h.shape[:-1], hi - lo, self.d))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def logits(self, h: Tensor, lo: int = 0, hi: int = 1, first: Tensor | None = None) -> Tensor:
        """Full-vocabulary logits of heads lo..hi-1: h [...,D] -> [...,hi-lo,V] (first: see states)."""
        return self.proj(self.final_norm(self.states(h, lo, hi, first)))

    def draft_logits(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """Logits of heads lo..hi-1 (lo >= 1) over the draft vocabulary, columns in draft_ids' order, in the
        proposal precision: h [...,D] -> [...,hi-lo,len(draft_ids)]; without a draft vocabulary `logits`. first:
        the token before head lo's target, which chained heads read (None: head lo-1's argmax)."""
        if self.draft_proj is None:
            return self.logits(h, lo, hi, first)
        return self.draft_proj(self.final_norm(self.states(h, lo, hi, first)))

    def head1(self, h: Tensor) -> Tensor:
        """Head 1's (the base model's) logits: h [...,D] -> [...,V]."""
        if self.identity_p1:
            return self.proj(self.final_norm(h))
        return self.logits(h, 0, 1).squeeze(-2)

    def head1_argmax(self, h: Tensor) -> Tensor:
        """Head 1's next token: h [...,D] -> ids [...] (the argmax of head1(h), in one native call where the
        kernels are built)."""
        ext = self.proj.native
        if ext is not None and self.identity_p1 and self.norm is not None:  # (the projection bias is in proj)
            _, w, b, eps = self.norm
            return ext.norm_project_argmax(h, w, b, eps, self.proj.lin)
        return self.head1(h).argmax(-1)

    def greedy_steps(
        self, model: nn.Module, state, tok: Tensor, room: np.ndarray, max_steps: int, eos: int | None = None
    ):
        """Up to `max_steps` greedy steps (one token per row per step, head 1's argmax fed back), stopping after
        the step in which a row ends (EOS, or its `room` tokens used up), so callers drop finished rows where
        a one-step loop would. tok [R] the next tokens to feed; the cache is written from `state.lengths` on
        and the caller advances `state.lengths` by the steps taken. Returns (tokens [R,s] numpy, decoder output
        of the last step [R,D]). The whole loop is one native call where the kernels are built (at demo size
        the per-step Python cost is as large as the step's arithmetic); same ops, so the same tokens.
        Sets `last_seconds`: the native loop's own time for these steps (None on the one-step path).
        eos: the id that ends a row (default the model's; benchmarks pass -1 to run max_steps steps)."""
        eos = model.config.eos_id if eos is None else eos
        loop = self.native_loop
        if loop is not None and max_steps > 0:
            t, per_row = cache_start(state)
            toks, h, self.last_seconds = loop(
                tok,
                model.pe,
                state.max_positions,
                self.native_layers,
                state.self_kv,
                state.mem_kv,
                state.mem_mask,
                state.mem_group,
                t,
                per_row,
                torch.from_numpy(room),
                max_steps,
                eos,
            )
            return toks.numpy(), h
        return python_greedy_steps(self, model, state, tok, room, max_steps, eos)

    def greedy_to_end(self, model: nn.Module, state, tok: Tensor, room: np.ndarray, max_steps: int, sampler=None):
        """greedy_steps until every row has ended (or `max_steps`), in one native call that drops finished rows
        itself (the last row's cache moved into each freed place), where returning to Python at every row's end and
        reordering the cache there would cost a round trip each. Returns (tokens [R,s]
        numpy, each row's steps [R] numpy: its tokens, the last a stop id where it ended on one), or None where the
        native loop does not run this model or its rows share memory rows (then use greedy_steps). The state's
        caches are left rearranged: drop it after. sampler: (settings, rng) of engine.step.native_sampler for
        sampled steps instead of greedy ones."""
        loop = self.native_loop
        if loop is None or max_steps < 1 or state.mem_group != 1:
            return None
        t, per_row = cache_start(state)
        toks, ends, self.last_seconds = loop(
            tok,
            model.pe,
            state.max_positions,
            self.native_layers,
            state.self_kv,
            state.mem_kv,
            state.mem_mask,
            1,
            t,
            per_row,
            torch.from_numpy(room),
            max_steps,
            model.config.eos_id,
            True,
            sampler,
        )
        return toks.numpy(), ends.numpy()

    def _block_parts(self, w: int, max_steps: int):
        """What the native blockwise loops take besides the layers, for a block of w fed tokens: (heads' FFN in,
        out, proposal projection, final norm weight, bias, eps), or None where they do not run this model."""
        if self.native_loop is None or self.heads is None or w < 2 or max_steps < 1:
            return None
        if self.chained:
            if self.chain is None:
                return None
            f1 = f2 = None
        else:
            f1, f2 = (lin.lin for lin in self._head_ffn(1, w))
        if self.prop_proj.lin is None:
            return None
        _, nw, nb, eps = self.norm
        return f1, f2, self.prop_proj, nw, nb, eps

    def block_steps(
        self,
        model: nn.Module,
        state,
        x: np.ndarray,
        room: int,
        max_steps: int,
        eos: int | None = None,
        width: int | None = None,
        rule: tuple[int, float] = (0, -1.0),
    ):
        """Blockwise steps for one row in uniform cache mode, as one native call (decoding/blockwise.py at batch 1;
        see csrc/loops.h block_steps): x [w] the fed tokens (x0 + w-1 proposals); rule: the acceptance rule's
        `native` (top_n, dist_eps), Exact by default. Returns
        (tokens gained [T], per step (accepted n, gained c) [s,2], next fed tokens [w], decoder output at the
        last accepted position [D], ended), or None where the native kernels do not run this model. Sets
        `last_seconds` (the native loop's own time, as greedy_steps). width: the block fed from the second step
        on (default len(x); x = [BOS] with width k is the prefill and the steps after it in one call)."""
        w = x.shape[0] if width is None else int(width)
        parts = self._block_parts(w, max_steps)
        if parts is None:
            return None
        f1, f2, draft, nw, nb, eps = parts
        toks, nc, nxt, hn, ended, self.last_seconds = self.ext.block_steps(
            torch.from_numpy(x),
            self._emb_w,
            self._emb_scale,
            model.pe,
            state.max_positions,
            self.native_layers,
            state.self_kv,
            state.mem_kv,
            state.mem_mask,
            state.base + state.lengths,
            nw,
            nb,
            eps,
            self.proj.lin,
            f1,
            f2,
            draft.lin,
            self.draft_ids,
            model.config.eos_id if eos is None else eos,
            int(room),
            int(max_steps),
            self.verify_group or verify_groups(self.proj)[0],
            w,
            self.chain,
            *rule,
        )
        return toks.numpy(), nc.numpy(), nxt.numpy(), hn, bool(ended)

    def batch_block_steps(
        self,
        model: nn.Module,
        state,
        x: np.ndarray,
        lengths: np.ndarray,
        room: np.ndarray,
        max_steps: int,
        width: int | None = None,
        eos: int | None = None,
        rule: tuple[int, float] = (0, -1.0),
        to_end: bool = False,
        sampler=None,
    ):
        """Blockwise steps (rule: as block_steps) for R rows in per-row cache mode, as one native call (decoding/blockwise.py at
        batch > 1; csrc/loops.h batch_block_steps): x [R,w] the fed tokens, lengths [R] each row's cached tokens
        (after `state.base`), room [R]. Stops after the step in which a row ends. Returns (tokens [R,T] of which
        the first counts[r] are row r's, per row and step (n, c) [R,s,2], next fed tokens [R,width], decoder
        output at each row's last accepted position [R,D], ended [R] bool), or None where the native kernels do
        not run this model. Sets `last_seconds`.
        to_end: run until every row has ended (or `max_steps`), finished rows leaving inside the call as in
        greedy_to_end (rows must not share memory rows; the state's caches are left rearranged: drop it after).
        Returns (tokens [R,T] of which the first counts[r] are row r's, histogram [w+1] of the tokens each row
        gained per step, steps, counts [R]).
        sampler: (settings, rng) of engine.step.native_sampler: blockwise sampling from x's start tokens [R,1] to every
        row's end (decoding/speculative.py; to_end's returns), width the block size."""
        w = x.shape[1] if width is None else int(width)
        parts = self._block_parts(w, max_steps)
        if parts is None:
            return None
        f1, f2, draft, nw, nb, eps = parts
        toks, nc, nxt, hn, ended, self.last_seconds = self.ext.batch_block_steps(
            torch.from_numpy(np.ascontiguousarray(x)),
            self._emb_w,
            self._emb_scale,
            model.pe,
            state.max_positions,
            self.native_layers,
            state.self_kv,
            state.mem_kv,
            state.mem_mask,
            state.mem_group,
            state.base,
            torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)),
            nw,
            nb,
            eps,
            self.proj.lin,
            f1,
            f2,
            draft.lin,
            self.draft_ids,
            model.config.eos_id if eos is None else eos,
            torch.from_numpy(np.ascontiguousarray(room, dtype=np.int64)),
            int(max_steps),
            self.batch_verify_group or verify_groups(self.proj)[1],
            w,
            self.chain,
            *rule,
            bool(to_end),
            *(sampler or (None, None)),
        )
        if to_end or sampler is not None:
            return toks.numpy(), nc.numpy(), int(nxt[0]), ended.numpy()
        return toks.numpy(), nc.numpy(), nxt.numpy(), hn, ended.numpy().astype(bool)

    def propose(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """Argmax tokens of heads lo..hi-1 (lo >= 1): h [...,D] -> ids [...,hi-lo], over the draft vocabulary
        when one is set. Proposals only decide what is verified, never the output.
        first [...]: the token before head lo's target (for lo = 1 head 1's token at h, which the decoders hold):
        what chained heads start from (None: computed here); other heads ignore it."""
        proj = self.prop_proj
        ext = proj.native
        if self.chained:
            if self.chain is not None and lo == 1 and self.norm is not None and proj.lin is not None:
                if first is None:
                    first = self.head1_argmax(h)
                _, w, b, eps = self.norm
                return ext.propose_chain(
                    h, torch.as_tensor(first, device=h.device), self.chain, hi - lo, w, b, eps, proj.lin, self.draft_ids
                )
            return self._chain_states(h, lo, hi, None if first is None else torch.as_tensor(first, device=h.device))[1]
        if ext is not None and lo >= 1 and self.norm is not None:
            f1, f2 = self._head_ffn(lo, hi)
            _, w, b, eps = self.norm
            return ext.propose(h, f1.lin, f2.lin, hi - lo, w, b, eps, proj.lin, self.draft_ids)
        s = self.final_norm(self.states(h, lo, hi))
        if self.draft_proj is None:
            return self.prop_proj(s).argmax(-1)
        return self.draft_ids[self.draft_proj(s).argmax(-1)]
