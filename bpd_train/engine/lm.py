"""The weights one decode step of a decoder-only model reads: `LMDecodeWeights`, the `DecodeStep` of engine/step.py
for LMModel (model/lm/model.py), as engine/mt.py's DecodeWeights is for the encoder-decoder BPDModel. The model
definition stays in model/lm/; this module is the decode engine's side: packed linears, the native layer stack and
the native loops (engine/fastlinear.py, csrc/lm.h)."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bpd_train.engine.fastlinear import PackedLinear, env_on, native_kernels
from bpd_train.engine.packed import DecodeOptions, copy_rows, draft_projection, verify_groups
from bpd_train.engine.step import DecodeStep, cache_start, python_greedy_steps, stop_array

log = logging.getLogger(__name__)

PREFIX_CACHE_BYTES = 64 << 20  # the last prompt's K/V kept for the next one's shared prefix, up to this size


def _common(a: Tensor, b: Tensor) -> int:
    """Length of the common prefix of two id vectors."""
    m = min(len(a), len(b))
    diff = (a[:m] != b[:m]).nonzero()
    return int(diff[0]) if len(diff) else m


def _stops(eos) -> Tensor:
    """The stop id(s) as the native loops take them: int64 [n]."""
    return torch.from_numpy(stop_array(eos))


class LMDecodeWeights(DecodeStep):
    """What decoders call per step (the DecodeStep interface of engine/step.py) for a decoder-only model:
    head1, head1_argmax, propose, logits, final_norm, greedy_steps, block_steps, batch_block_steps, vocab_size,
    draft_ids, stats.

    Where the native kernels run (CPU, fp32 weights; engine/fastlinear.py) every linear of the step is a
    `PackedLinear` in `options.dtype` (fp32 / bf16 / int8: q/k/v with their biases, o, gate/up, down, the
    vocabulary projection, the heads' FFN or Medusa blocks; heads 2..k in `proposal_dtype` and over the draft
    vocabulary where set, head 1 always over the full vocabulary in `dtype`), and the layer stack is one native
    call (csrc/lm.h lm_decode_layers: RMSNorm, rotary, GQA attention one query at a time over the row's cache
    slots, SwiGLU), so a row's decoder output is bit-identical alone or in a block: exact blockwise decoding
    returns greedy's output of the same precision. Greedy and exact blockwise (one row and a batch) then run as
    native loops (lm_greedy_steps / lm_block_steps / lm_batch_block_steps; any of the model's stop ids ends a row).
    Elsewhere (CUDA, BPD_DECODE_ENGINE=torch, no compiler) the step is LMModel's torch path in fp32.

    What the engine does not look up in the model is given: `medusa`, whether the heads are Medusa heads (else BPD
    heads, or none), and `stops`, the id or ids that end a row where a caller passes no `eos` (engine/weights.py
    build_step_weights reads them off the model)."""

    # cache rows copied in one native call where the kernels are loaded (model/cache.py DecoderState.reorder)
    copy_rows = staticmethod(copy_rows)

    def __init__(self, model: nn.Module, options: DecodeOptions, *, medusa: bool, stops):
        self.options = options
        # the modules a step reads outside the packed linears (not the model itself: a decoder's cache of these
        # weights must not keep the model alive)
        self._norm, self._embed = model._modules["norm"], model._modules["embed"]
        self.stops = stop_array(stops)
        c = model.config
        dt = options.dtype
        emb = model.output_weight()
        ext = native_kernels() if emb.device.type == "cpu" and emb.dtype == torch.float32 else None
        if ext is None and dt != "fp32":
            raise ValueError(
                f"decoder-only models decode in fp32 where the native CPU kernels do not run "
                f"(decode dtype {dt!r} asked; engine: torch)"
            )
        self.vocab_size = c.vocab_size
        self.k, self.d = c.block_size, c.d_model
        self.stats: dict = {}
        self.last_seconds: float | None = None
        heads = model._modules.get("heads")
        self.heads = heads
        self.medusa = heads is not None and bool(medusa)
        self.chained = bool(getattr(heads, "chained", False))  # heads that read the token before their own
        self.identity_p1 = heads is None or heads.identity_p1
        self.pdt = (options.proposal_dtype or dt) if self.identity_p1 else dt
        vdt, vpdt = _vocab_dtype(dt), _vocab_dtype(self.pdt)
        self.proj = PackedLinear(emb, None, vdt, screen=True)
        self.draft_ids, self.draft_proj = draft_projection(emb, None, options.draft_vocab, vpdt)
        self.prop_proj = self.draft_proj or (
            self.proj if vpdt == vdt or heads is None else PackedLinear(emb, None, vpdt)
        )
        self._props: dict[tuple[int, int], tuple] = {}
        self._prefix: tuple[Tensor, Tensor] | None = None  # (ids [n], K/V [L,2,G,n,Dh]) of the last prompt: prefill()
        self.verify_group: int | None = None  # as DecodeWeights: None = verify_groups decides
        self.batch_verify_group: int | None = None
        self.ext = ext
        self.native_layers = self.native_loop = None
        # the K/V cache's element (LMModel.start_decoding): half precision in the precisions that already round
        # beyond fp32 on the native engine (half the bytes attention reads a token), float32 in fp32 and on torch
        self.kv_dtype = torch.float16 if ext is not None and dt != "fp32" and env_on("BPD_KV_HALF") else torch.float32
        self.lin: list = []
        if ext is not None:
            smooth = int8_smoothing(model) if dt == "int8" and env_on("BPD_INT8_SMOOTH") else None
            norms = []
            for i, layer in enumerate(model.layers):
                a, m = layer._modules["attn"], layer._modules["mlp"]
                n1, n2 = layer._modules["norm1"], layer._modules["norm2"]
                n1w, n2w = n1._parameters["weight"].detach(), n2._parameters["weight"].detach()
                if smooth is None:
                    # q4: a file's own 4-bit blocks; its other tensors in int8 (quantised to 4 bits at load below
                    # where the model holds no 4-bit blocks at all)
                    lins = [_plin(a.qkv, dt, False), _plin(a.o, dt, False), _plin(m.gate_up, dt, False),
                            _plin(m.down, dt, False)]  # fmt: skip
                else:
                    w = smooth[i]
                    n1w, n2w = w["norm1"], w["norm2"]
                    lins = [
                        PackedLinear(w["qkv"], w["qkv_b"], dt),
                        PackedLinear(w["o"], a.o._parameters["bias"], dt),
                        PackedLinear(w["gate_up"], w["gate_up_b"], dt),
                        PackedLinear(w["down"], m.down._parameters["bias"], dt),
                    ]
                self.lin.append(lins)
                norms.append((n1w, n2w))
            if dt == "q4":
                if not any(p.q4 for lins in self.lin for p in lins):  # hf: / own models: 4-bit blocks made at load
                    for lins, layer in zip(self.lin, model.layers):
                        a, m = layer._modules["attn"], layer._modules["mlp"]
                        lins[:] = [_plin(a.qkv, dt), _plin(a.o, dt), _plin(m.gate_up, dt), _plin(m.down, dt)]
                _log_q4([lin for lins in self.lin for lin in lins])
            layers = []
            for layer, lins, (n1w, n2w) in zip(model.layers, self.lin, norms):
                a = layer._modules["attn"]
                n1 = layer._modules["norm1"]
                layers.append(
                    ext.LMLayer(
                        a.n_heads,
                        a.n_kv,
                        a.dh,
                        n1.eps,
                        n1w,
                        lins[0].lin,
                        lins[1].lin,
                        n2w,
                        lins[2].lin,
                        lins[3].lin,
                    )
                )
            norm = model._modules["norm"]
            self.native_layers = ext.LMNet(
                layers,
                model._modules["embed"]._parameters["weight"].detach(),
                norm._parameters["weight"].detach(),
                norm.eps,
                self.proj.lin,
            )
            # the native loops: head 1 is the LM head itself (identity_p1; BPD heads with their own head 1 take
            # the Python steps over the same native pieces)
            self.native_loop = self.native_layers if self.identity_p1 else None
        if options.tree and (self.native_loop is None or self.chained):
            raise ValueError(
                "tree: candidate trees run on the native CPU loop with Medusa or BPD heads whose head 1 is the LM's "
                "own (this model or engine has "
                + ("chained heads" if self.chained else "no native loop: CUDA, BPD_DECODE_ENGINE=torch or own head 1")
                + "); leave decode.tree empty"
            )

    # ---- the prompt ----
    def prefill(self, state, ids: Tensor) -> None:
        """Cache the prompt prefixes ids [R,T] (left-padded by state.lpad) at slots 0..T-1 on the native stack, each
        row as it would be alone. The tokens every row shares with the last prefilled prompt (a chat's system turn)
        are copied from that prompt's cache instead of computed: the kernels are row-exact, so the copy holds the
        bits a full prefill writes (BPD_PREFIX_CACHE=0: always the full prefill)."""
        r, t = ids.shape
        kv, lpad = state.self_kv, state.lpad  # kv [L,2,R,G,S,Dh]
        keep = env_on("BPD_PREFIX_CACHE")
        n, start = 0, 0
        got = self._prefix if keep else None
        if got is not None:
            old, old_kv = got
            rows = [ids[i, int(lpad[i]) :] for i in range(r)]
            n = min(_common(old, row) for row in rows)
            for i in range(r):
                kv[:, :, i, :, int(lpad[i]) : int(lpad[i]) + n] = old_kv[:, :, :, :n]
            start = int(lpad.min()) + n  # slots below hold each row's pads or copied prefix
        if start < t:
            slots = torch.arange(start, t).expand(r, t - start)
            self.ext.lm_decode_layers(ids[:, start:], self.native_layers, kv, lpad, state.cos, state.sin, slots)
        p0 = int(lpad[0])
        per_token = kv[:, :, 0, :, 0].numel() * kv.element_size()
        end = min(t, p0 + PREFIX_CACHE_BYTES // per_token)  # a long prompt keeps its head: where prompts agree
        if keep and end > p0:
            self._prefix = (ids[0, p0:end].clone(), kv[:, :, 0, :, p0:end].clone())

    # ---- the pieces of a step ----
    def final_norm(self, h: Tensor) -> Tensor:
        norm = self._norm
        if self.native_layers is not None and h.dtype == torch.float32:
            return self.ext.rms_norm(h, norm._parameters["weight"].detach(), norm.eps)  # the native loops' norm
        return norm(h)

    def _head_lins(self, lo: int, hi: int):
        """Packed linears of heads lo..hi-1 (lo >= 1, or lo = 0 for BPD heads without identity head 1) and the
        LMProp the native proposal path takes (None on the torch path)."""
        key = (lo, hi)
        got = self._props.get(key)
        if got is None:
            hd, dt, d = self.heads, self.pdt, self.d
            if self.medusa:
                w, b = hd._parameters["weight"].detach(), hd._parameters["bias"].detach()
                lins = [PackedLinear(w[i - 1, j], b[i - 1, j], dt) for i in range(lo, hi) for j in range(hd.n_layers)]
                kind, nl = 1, hd.n_layers
            elif self.chained:
                p = {n: t.detach() for n, t in hd._parameters.items()}
                lins = [
                    lin
                    for i in range(lo, hi)
                    for lin in (
                        PackedLinear(p["tok"][i - 1], None, dt),
                        PackedLinear(p["w1"][i - 1], p["b1"][i - 1], dt),
                        PackedLinear(p["w2"][i - 1], p["b2"][i - 1], dt),
                    )
                ]
                kind, nl = 2, 0
            else:
                fc1, fc2 = hd.fc1._parameters, hd.fc2._parameters
                s0, s1 = hd.slot(lo), hd.slot(hi)
                lins = [
                    PackedLinear(fc1["weight"], fc1["bias"], dt),
                    PackedLinear(fc2["weight"][s0 * d : s1 * d], fc2["bias"][s0 * d : s1 * d], dt),
                ]
                kind, nl = 0, 0
            prop = None
            if self.ext is not None and all(p.lin is not None for p in lins) and self.prop_proj.lin is not None:
                prop = self.ext.LMProp(kind, hi - lo, nl, [p.lin for p in lins], self.prop_proj.lin, self.draft_ids)
            got = self._props[key] = (lins, prop)
        return got

    def states(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """h [...,D] -> what the vocabulary projection reads for heads lo..hi-1 [...,hi-lo,D] (model.head_states on
        the packed linears). Chained heads read first [...], the token before head lo's target (None: head lo-1's
        argmax), then each head's own proposal."""
        parts = []
        if lo == 0 and self.identity_p1:
            parts.append(self.final_norm(h).unsqueeze(-2))
            lo = 1
        if lo < hi:
            lins, _ = self._head_lins(lo, hi)
            if self.chained:
                prev = first if first is not None else self.propose_torch(h, lo - 1, lo).squeeze(-1)
                emb = self._embed._parameters["weight"].detach()
                for i in range(hi - lo):
                    tok, w1, w2 = lins[3 * i : 3 * i + 3]
                    x = h + tok(F.embedding(prev, emb))
                    s = self.final_norm(h + w2(torch.relu(w1(x))))
                    parts.append(s.unsqueeze(-2))
                    prev = self._draft_argmax(s)
            elif self.medusa:
                n, nl = self.final_norm(h), self.heads.n_layers
                for i in range(hi - lo):
                    x = n
                    for j in range(nl):
                        x = x + F.silu(lins[i * nl + j](x))
                    parts.append(x.unsqueeze(-2))
            else:
                out = lins[1](torch.relu(lins[0](h)))
                parts.append(self.final_norm(h.unsqueeze(-2) + out.view(*h.shape[:-1], hi - lo, self.d)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def logits(self, h: Tensor, lo: int = 0, hi: int = 1, first: Tensor | None = None) -> Tensor:
        """Full-vocabulary logits of heads lo..hi-1: h [...,D] -> [...,hi-lo,V] (first: see states)."""
        return self.proj(self.states(h, lo, hi, first))

    def draft_logits(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """Logits of heads lo..hi-1 (lo >= 1) over the draft vocabulary, columns in draft_ids' order, in the
        proposal precision: h [...,D] -> [...,hi-lo,len(draft_ids)]; without a draft vocabulary `logits`. first:
        the token before head lo's target, which chained heads read (None: head lo-1's argmax)."""
        if self.draft_proj is None:
            return self.logits(h, lo, hi, first)
        return self.draft_proj(self.states(h, lo, hi, first))

    def head1(self, h: Tensor) -> Tensor:
        """Head 1's (the LM's) logits: h [...,D] -> [...,V]."""
        if self.identity_p1:
            return self.proj(self.final_norm(h))
        return self.logits(h, 0, 1).squeeze(-2)

    def head1_argmax(self, h: Tensor) -> Tensor:
        """Head 1's next token [...] (one native call where the kernels run: the loops' own arithmetic)."""
        if self.native_layers is not None and self.identity_p1:
            return self.ext.lm_head1_argmax(h, self.native_layers)
        return self.head1(h).argmax(-1)

    def propose(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """Argmax ids of heads lo..hi-1 (lo >= 1) [...,hi-lo], over the draft vocabulary when one is set (first:
        the token before head lo's target, which only chained heads read; None: computed)."""
        if self.chained:
            if first is None:
                first = self.head1_argmax(h) if lo == 1 else self.propose(h, lo - 1, lo)[..., 0]
            first = torch.as_tensor(first, device=h.device).reshape(h.shape[:-1]).contiguous()
        if self.native_layers is not None and lo >= 1:
            _, prop = self._head_lins(lo, hi)
            if prop is not None:
                return self.ext.lm_propose(h, self.native_layers, prop, first if self.chained else None)
        return self.propose_torch(h, lo, hi, first)

    def _draft_argmax(self, s: Tensor) -> Tensor:
        if self.draft_proj is None:
            return self.prop_proj(s).argmax(-1)
        return self.draft_ids[self.draft_proj(s).argmax(-1)]

    def propose_torch(self, h: Tensor, lo: int, hi: int, first: Tensor | None = None) -> Tensor:
        """propose() on the torch path (head 0: head 1's own argmax)."""
        if lo == 0:
            return self.head1_argmax(h).unsqueeze(-1)
        return self._draft_argmax(self.states(h, lo, hi, first))

    # ---- loops ----
    def greedy_steps(self, model, state, tok: Tensor, room, max_steps: int, eos=None):
        """DecodeWeights.greedy_steps (same contract); a row ends on any of the stop ids (`stops` where eos is None:
        LMConfig.eos_ids where a checkpoint lists several). One native call where the kernels run."""
        eos = self.stops if eos is None else eos
        net = self.native_loop
        if net is not None and max_steps > 0:
            t, per_row = cache_start(state)
            toks, h, self.last_seconds = self.ext.lm_greedy_steps(
                tok,
                net,
                state.self_kv,
                state.lpad,
                state.cos,
                state.sin,
                t,
                per_row,
                _stops(eos),
                torch.from_numpy(np.ascontiguousarray(room, dtype=np.int64)),
                int(max_steps),
                False,
                None,
                None,
            )
            return toks.numpy(), h
        return python_greedy_steps(self, model, state, tok, room, max_steps, eos)

    def greedy_to_end(self, model, state, tok: Tensor, room, max_steps: int, sampler=None):
        """DecodeWeights.greedy_to_end (same contract, sampled steps too): every row to its end in one native
        call, or None."""
        net = self.native_loop
        if net is None or max_steps < 1:
            return None
        t, per_row = cache_start(state)
        toks, ends, self.last_seconds = self.ext.lm_greedy_steps(
            tok,
            net,
            state.self_kv,
            state.lpad,
            state.cos,
            state.sin,
            t,
            per_row,
            _stops(self.stops),
            torch.from_numpy(np.ascontiguousarray(room, dtype=np.int64)),
            int(max_steps),
            True,
            *(sampler or (None, None)),
        )
        return toks.numpy(), ends.numpy()

    def _block_prop(self, w: int, max_steps: int):
        if self.native_loop is None or self.heads is None or w < 2 or max_steps < 1:
            return None
        return self._head_lins(1, w)[1]

    def _context(self, context) -> tuple[list[torch.Tensor], int]:
        n = self.options.lookup
        if not n or context is None:
            return [], 0
        return [torch.from_numpy(np.ascontiguousarray(c, dtype=np.int64)) for c in context], n

    @property
    def narrows(self) -> bool:
        """Whether the one-row native loop picks each step's width (DecodeOptions.narrow with lookup): its next
        fed block may be narrower than the block size, and is fed as it is."""
        return bool(
            ((self.options.lookup and self.options.narrow) or self.options.tree) and self.native_loop is not None
        )

    def block_steps(
        self,
        model,
        state,
        x: np.ndarray,
        room: int,
        max_steps: int,
        eos=None,
        width: int | None = None,
        rule: tuple[int, float] = (0, -1.0),
        context=None,
    ):
        """DecodeWeights.block_steps (same contract) for one row: blockwise steps as one native call, or None
        where the native kernels do not run this model. context: [the row's prompt and tokens so far] for
        prompt lookup (DecodeOptions.lookup)."""
        w = x.shape[0] if width is None else int(width)
        prop = self._block_prop(w, max_steps)
        if prop is None:
            return None
        toks, nc, nxt, hn, ended, self.last_seconds = self.ext.lm_block_steps(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)),
            self.native_loop,
            prop,
            state.self_kv,
            state.lpad,
            state.cos,
            state.sin,
            state.base + state.lengths,
            _stops(self.stops if eos is None else eos),
            int(room),
            int(max_steps),
            self.verify_group or verify_groups(self.proj)[0],
            w,
            *rule,
            *self._context(context),
            self.options.narrow if context is not None else 0,
            self._tree(w),
        )
        return toks.numpy(), nc.numpy(), nxt.numpy(), hn, bool(ended)

    def _tree(self, w: int) -> Tensor | None:
        """DecodeOptions.tree as the native loop's [paths, depth] ranks (-1 pads), or None; its depth must fit the
        heads this call proposes with (w - 1)."""
        tree = self.options.tree
        if not tree:
            return None
        depth = max(len(p) for p in tree)
        if depth > w - 1:
            raise ValueError(f"tree: a path {depth} heads deep needs a block size of at least {depth + 1}, got {w}")
        return torch.tensor([list(p) + [-1] * (depth - len(p)) for p in tree], dtype=torch.long)

    def batch_block_steps(
        self,
        model,
        state,
        x: np.ndarray,
        lengths: np.ndarray,
        room: np.ndarray,
        max_steps: int,
        width: int | None = None,
        eos=None,
        rule: tuple[int, float] = (0, -1.0),
        to_end: bool = False,
        context=None,
        sampler=None,
    ):
        """DecodeWeights.batch_block_steps (same contract, to_end and sampler too) for R rows in per-row cache mode,
        or None where the native kernels do not run this model. context: each row's prompt and tokens so far
        (lookup; with a sampler, narrow steps too, and for one row DecodeOptions.tree)."""
        w = x.shape[1] if width is None else int(width)
        prop = self._block_prop(w, max_steps)
        if prop is None:
            return None
        toks, nc, nxt, hn, ended, self.last_seconds = self.ext.lm_batch_block_steps(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)),
            self.native_loop,
            prop,
            state.self_kv,
            state.lpad,
            state.cos,
            state.sin,
            state.base,
            torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)),
            _stops(self.stops if eos is None else eos),
            torch.from_numpy(np.ascontiguousarray(room, dtype=np.int64)),
            int(max_steps),
            self.batch_verify_group or verify_groups(self.proj)[1],
            w,
            *rule,
            bool(to_end),
            *self._context(context),
            int(self.options.narrow or 0) if sampler is not None and context is not None else 0,
            *(sampler or (None, None)),
            self._tree(w) if sampler is not None and x.shape[0] == 1 else None,
        )
        if to_end or sampler is not None:
            return toks.numpy(), nc.numpy(), int(nxt[0]), ended.numpy()
        return toks.numpy(), nc.numpy(), nxt.numpy(), hn, ended.numpy().astype(bool)

    # the native loops end rows on any of several stop ids, and propose from a row's context (decoding/blockwise.py
    # asks)
    multi_stop = True
    lookup_context = True


def _vocab_dtype(dtype: str) -> str:
    """The vocabulary projection's precision: q4 reads it in int8 (llama.cpp keeps a file's output projection at its
    own 8 or 6 bits: 4 bits there move answers most), any other dtype as given."""
    return "int8" if dtype == "q4" else dtype


def _log_q4(lins: list[PackedLinear]) -> None:
    """One line on what q4 made of a model's layer linears: the file's 4-bit blocks, quantised at load, or int8."""
    n = len(lins)
    kept = sum(p.q4 == "file" for p in lins)
    load = sum(p.q4 == "load" for p in lins)
    if kept == n:
        log.info("decode dtype q4: all %d layer linears keep the file's 4-bit blocks (Q4_0 / Q4_1 / Q4_K)", n)
    elif kept:
        log.warning(
            "decode dtype q4: %d of %d layer linears keep the file's 4-bit blocks; the other %d (not Q4_0 / Q4_1 / "
            "Q4_K blocks of 32: Q5 / Q6 / Q8 types, F16 / F32 tensors) run in int8",
            kept, n, n - kept,
        )  # fmt: skip
    else:
        log.warning(
            "decode dtype q4: the model holds no Q4_0 / Q4_1 / Q4_K blocks of 32; %d of its %d layer linears are "
            "quantised to 4-bit blocks at load (as gguf's Q4_1)%s",
            load, n, f", {n - load} run in int8 (inner size not a multiple of 32)" if n > load else "",
        )  # fmt: skip


def _plin(mod: nn.Linear, dtype: str, quantize: bool = True) -> PackedLinear:
    p = mod._parameters
    return PackedLinear(p["weight"], p["bias"], dtype, quantize=quantize)


def int8_smoothing(model: nn.Module, alpha: float = 0.5) -> list[dict[str, Tensor]]:
    """Each layer's weights with per-input-channel scales s folded in for int8 (SmoothQuant, Xiao et al. 2023):
    (x / s) (W s)^T is x W^T, but int8's one scale per activation row no longer follows a few large channels.
    s = amax(x)^alpha / amax(W)^(1 - alpha), x the model's own activations on fixed pseudo-random ids (the same
    scales every time, no tokenizer or text needed). 1/s goes into the RMSNorm before q/k/v and gate/up, into v's
    rows before o (shared by a kv group's heads) and into up's rows before down: the same function in exact
    arithmetic, answers nearer fp32's in int8 (docs/engine.md)."""
    c, layers = model.config, model.layers
    amax: dict[tuple[int, str], Tensor] = {}

    def hook(key):
        def record(mod, inp, out):
            a = inp[0].detach().abs().reshape(-1, inp[0].shape[-1]).amax(0)
            amax[key] = torch.maximum(amax[key], a) if key in amax else a

        return record

    hooks = [
        mod.register_forward_hook(hook((i, name)))
        for i, layer in enumerate(layers)
        for name, mod in (("qkv", layer.attn.qkv), ("o", layer.attn.o), ("gate_up", layer.mlp.gate_up),
                          ("down", layer.mlp.down))
    ]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(c.vocab_size, 8192), (8, min(96, c.max_positions)), generator=g)
    was_training = model.training
    try:
        with torch.no_grad():
            model.train(False)  # (no dropout in the statistics)
            model.features(ids)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()

    def scales(key, w: Tensor) -> Tensor:  # [in]
        x = amax[key].clamp(min=1e-5) ** alpha
        return (x / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)).clamp(1e-2, 1e2)

    out = []
    rep, dh, kv = layers[0].attn.n_heads // layers[0].attn.n_kv, layers[0].attn.dh, layers[0].attn.n_kv
    with torch.no_grad():
        for i, layer in enumerate(layers):
            qkv, o, gu, down = layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down
            s1, s2 = scales((i, "qkv"), qkv.weight), scales((i, "gate_up"), gu.weight)
            so = scales((i, "o"), o.weight).view(kv, rep, dh).amax(1)  # [G,Dh]: one per kv group's channel
            sd = scales((i, "down"), down.weight)
            wqkv = qkv.weight * s1
            bqkv = None if qkv.bias is None else qkv.bias.clone()
            v0 = wqkv.shape[0] - kv * dh  # v's rows come last
            wqkv[v0:] /= so.reshape(-1, 1)
            if bqkv is not None:
                bqkv[v0:] /= so.reshape(-1)
            f = down.weight.shape[1]  # up's rows follow gate's
            wgu = gu.weight * s2
            wgu[f:] /= sd.reshape(-1, 1)
            bgu = None if gu.bias is None else gu.bias.clone()
            if bgu is not None:
                bgu[f:] /= sd
            out.append(
                {
                    "norm1": (layer.norm1.weight / s1).contiguous(),
                    "qkv": wqkv.contiguous(),
                    "qkv_b": bqkv,
                    "o": (o.weight * so.unsqueeze(1).expand(kv, rep, dh).reshape(1, -1)).contiguous(),
                    "norm2": (layer.norm2.weight / s2).contiguous(),
                    "gate_up": wgu.contiguous(),
                    "gate_up_b": bgu,
                    "down": (down.weight * sd).contiguous(),
                }
            )
    return out
