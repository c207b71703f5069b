// The decoder-only (Llama-style) model's native pieces: RMSNorm, rotary positions, grouped-query attention, SwiGLU,
// its proposal heads, its LoopModel (LMLoop) and entry points.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "loops.h"

// ==== decoder-only (Llama / Qwen2 / Mistral-style) models: model/lm.py LMModel ====
// The layer stack of one decode step on raw buffers, as decode_raw is for the encoder-decoder stack: RMSNorm,
// q/k/v (one packed linear, optional biases), rotary positions (rotate-half layout, per-row positions = slot -
// lpad), grouped-query attention over the row's cache slots lpad..slot (each query's arithmetic its own), output projection,
// SwiGLU (gate and up in one packed linear, then down). Every row is computed by the same code whatever the batch
// or the number of tokens fed, so a token's decoder output is bit-identical alone (greedy) or inside a block
// (blockwise verification). Results differ from the torch path (LMModel._run) by rounding only.

// y = weight * (x * rsqrt(mean(x^2) + eps)) per row (statistics in double, summed in a fixed order)
static void rms_rows(const float* x, float* y, int64_t M, int64_t D, const float* w, float eps) {
  thread_local std::vector<double> tmp;
  if ((int64_t)tmp.size() < D) tmp.resize(D);
  double* t = tmp.data();
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    for (int64_t i = 0; i < D; i++) t[i] = (double)xr[i] * (double)xr[i];
    const double ms = sum8(t, D) / (double)D;
    const float inv = (float)(1.0 / std::sqrt(ms + (double)eps));
    for (int64_t i = 0; i < D; i++) yr[i] = w[i] * (xr[i] * inv);
  }
}

static inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// act[i] = silu(g[i]) * u[i] (SwiGLU): the scalar path's operations (v / (1 + exp(-v)), then times u) with exp
// vectorised (vexp, ~1 ulp; the tail past whole vectors: std::exp): the same per element whatever the row or the
// number of rows, so rows stay exact. act may be g itself.
static inline void silu_gate(const float* g, const float* u, float* act, int64_t f) {
  const float one = 1.0f;
  const vf ones = vbcast(&one);
  int64_t i = 0;
  for (; i + L <= f; i += L) {
    const vf v = vload(g + i);
    vstore(act + i, vmul(vdiv(v, vadd(ones, vexp(vsub(vzero(), v)))), vload(u + i)));
  }
  for (; i < f; i++) act[i] = silu(g[i]) * u[i];
}

// x[i] += silu(t[i]) over one row of n (a residual head layer), exp vectorised as in silu_gate
static inline void silu_add(const float* t, float* x, int64_t n) {
  const float one = 1.0f;
  const vf ones = vbcast(&one);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const vf v = vload(t + i);
    vstore(x + i, vadd(vload(x + i), vdiv(v, vadd(ones, vexp(vsub(vzero(), v))))));
  }
  for (; i < n; i++) x[i] += silu(t[i]);
}

// One decoder-only layer's decode-step weights (model/lm.py Layer).
struct LMLayer {
  int64_t n_heads, n_kv, dh;
  double eps;
  torch::Tensor n1w, n2w;
  Lin qkv, o, gate_up, down;
  LMLayer(int64_t h, int64_t g, int64_t dh_, double e, torch::Tensor a, Lin l1, Lin l2, torch::Tensor b, Lin l3,
          Lin l4)
      : n_heads(h), n_kv(g), dh(dh_), eps(e), n1w(a.contiguous()), n2w(b.contiguous()), qkv(l1), o(l2), gate_up(l3),
        down(l4) {
    TORCH_CHECK(qkv.N == (h + 2 * g) * dh && o.K == h * dh && gate_up.N == 2 * down.K, "LMLayer: shapes disagree");
  }
};

// The whole step's weights: layers, token embedding, final RMSNorm, the vocabulary projection (head 1).
struct LMNet {
  std::vector<LMLayer> layers;
  torch::Tensor embed, nw;
  double eps;
  Lin proj;
  int64_t d;
  LMNet(std::vector<LMLayer> l, torch::Tensor e, torch::Tensor w, double ep, Lin p)
      : layers(std::move(l)), embed(e.contiguous()), nw(w.contiguous()), eps(ep), proj(p), d(e.size(1)) {
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && nw.scalar_type() == torch::kFloat32,
                "LMNet: float32 embedding and norm");
  }
};

// The proposal path for heads 1..n_heads: kind 0 = BPD heads (lins = {fc1, fc2 rows of those heads}: state_i =
// h + fc2(relu(fc1(h)))[i], then the final norm), kind 1 = Medusa heads (lins[i * n_layers + l]: x = norm(h),
// x += silu(W_il x + b_il) per layer), kind 2 = chained heads (lins[3 i ..]: tok_i, w1_i, w2_i; model/heads.py
// ChainHeads: x = h + tok_i(embed[prev]), state_i = h + w2_i(relu(w1_i x)), then the final norm; prev is head 1's
// token for the first head, then each head's own proposal); then `proj` (the draft vocabulary's rows where one is
// set, ids mapped back).
struct LMProp {
  int64_t kind, n_heads, n_layers;
  std::vector<Lin> lins;
  Lin proj;
  torch::Tensor draft;
  LMProp(int64_t k, int64_t nh, int64_t nl, std::vector<Lin> l, Lin p, c10::optional<torch::Tensor> ids)
      : kind(k), n_heads(nh), n_layers(nl), lins(std::move(l)), proj(p) {
    if (ids.has_value()) draft = ids->to(torch::kLong).contiguous();
    TORCH_CHECK(kind == 0   ? lins.size() == 2
                : kind == 1 ? (int64_t)lins.size() == nh * nl
                            : kind == 2 && (int64_t)lins.size() == 3 * nh,
                "LMProp: wrong kind or number of linears");
  }
};

// KV cache [layers,2,R,G,cap,Dh] (model/lm.py LMState), float32 or float16 (half: the precisions other than fp32,
// engine/lm.py kv_dtype), each row's pad slots lpad [R], rotary tables [cap, Dh]
struct LMCache {
  void* kv;
  bool half;
  int64_t ks[6], kn[6], cap, rope_n, dh;
  mutable std::vector<int64_t> lpad;            // (move_row rearranges it with the rows)
  torch::Tensor cos_keep, sin_keep;
  const float* cos;
  const float* sin;
  LMCache(const torch::Tensor& self_kv, const torch::Tensor& lp, const torch::Tensor& cos_t, const torch::Tensor& sin_t) {
    TORCH_CHECK(self_kv.scalar_type() == torch::kFloat32 || self_kv.scalar_type() == torch::kHalf,
                "decode: float32 or float16 caches only");
    half = self_kv.scalar_type() == torch::kHalf;
    for (int i = 0; i < 6; i++) {
      ks[i] = self_kv.stride(i);
      kn[i] = self_kv.size(i);
    }
    TORCH_CHECK(ks[5] == 1, "decode: caches must be contiguous in the head dimension");
    kv = self_kv.data_ptr();
    cap = self_kv.size(4);
    dh = self_kv.size(5);
    auto l = lp.to(torch::kLong).contiguous();
    TORCH_CHECK(l.numel() == self_kv.size(2), "decode: lpad must be [R]");
    lpad.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
    cos_keep = cos_t.to(torch::kFloat32).contiguous();
    sin_keep = sin_t.to(torch::kFloat32).contiguous();
    TORCH_CHECK(cos_keep.size(-1) == dh && sin_keep.sizes() == cos_keep.sizes(), "decode: rotary tables [n, Dh]");
    rope_n = cos_keep.size(0);
    cos = cos_keep.data_ptr<float>();
    sin = sin_keep.data_ptr<float>();
  }
  // row dst = row src: its first `filled` slots and its left padding
  void move_row(int64_t dst, int64_t src, int64_t filled) const {
    if (half) move_cache_row((f16*)kv, ks, kn, dst, src, filled);
    else move_cache_row((float*)kv, ks, kn, dst, src, filled);
    lpad[dst] = lpad[src];
  }
};

// x*cos + rotate_half(x)*sin for n_h heads of dh at one position (the torch path's three roundings)
static inline void rope(float* x, int64_t n_h, int64_t dh, const float* c, const float* s) {
  const int64_t half = dh / 2;
  thread_local std::vector<float> tmp;
  float* t = grow(tmp, dh);
  for (int64_t hh = 0; hh < n_h; hh++) {
    float* v = x + hh * dh;
    for (int64_t i = 0; i < half; i++) t[i] = v[i] * c[i] + (-v[i + half]) * s[i];   // two branch-free halves: vectorised
    for (int64_t i = half; i < dh; i++) t[i] = v[i] * c[i] + v[i - half] * s[i];
    std::memcpy(v, t, dh * sizeof(float));
  }
}

// x [M][d] (embedded tokens, in place -> output before the final norm); row m is cache row m / n at slot[m]. A query
// at slot p of row r sees slots lpad[r]..p (a pad slot, in a prefill, sees itself only: its output is never read).
// tree (one cache row, M = n <= 64 fed at slots slot[0]..): row m is a candidate tree's node at rotary slot
// tree->pslot[m] (its depth after slot[0]) and sees the slots before slot[0] and the fed rows in bit set anc[m].
struct TreeRows {
  const int64_t* pslot;
  const uint64_t* anc;
};
// bytes of the next linear's weights fetched into L2 ahead of it, during the attention or the norms before it (the
// first blocks of each matrix missed every cache: docs/experiments.md 8.17)
constexpr int64_t PF_NEXT = 64 << 10;
template <typename T>
static void lm_decode_raw_t(float* x, int64_t M, int64_t n, const int64_t* slot, const LMNet& net, const LMCache& c,
                            const TreeRows* tree) {
  Work& ws = work();
  const int64_t d = net.d;
  int64_t wide = 0, hd = 0, max_slot = 0;
  for (const auto& w : net.layers) {
    wide = std::max(wide, std::max(w.qkv.N, w.gate_up.N));
    hd = std::max(hd, w.n_heads * w.dh);
  }
  for (int64_t m = 0; m < M; m++) max_slot = std::max(max_slot, slot[m]);
  TORCH_CHECK(max_slot < c.cap, "KV cache capacity ", c.cap, " exceeded (needs ", max_slot + 1, ")");
  float* y = grow(ws.y, M * d);
  float* big = grow(ws.big, M * wide);
  float* a = grow(ws.a, M * std::max(hd, d));
  float* o = grow(ws.o, M * d);
  const int64_t* ks = c.ks;
  Tick tk;
  for (size_t li = 0; li < net.layers.size(); li++) {
    const LMLayer& w = net.layers[li];
    const int64_t h = w.n_heads, g = w.n_kv, dh = w.dh, qn = w.qkv.N, rep = h / g;
    TORCH_CHECK(dh == c.dh, "decode: head size disagrees with the cache");
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    rms_rows(x, y, M, d, w.n1w.data_ptr<float>(), (float)w.eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.qkv, y, big, M);                                               // [M][q H*Dh | k G*Dh | v G*Dh]
    prefetch_lin(w.o, PF_NEXT);                                                // memory is idle during attention
    tk.to(P_DEC_LIN);
    T* kl = (T*)c.kv + li * ks[0];
    for (int64_t m = 0; m < M; m++) {
      const int64_t row = m / n;
      const int64_t ps = tree ? tree->pslot[m] : slot[m];
      const int64_t pos = std::min(std::max<int64_t>(ps - c.lpad[row], 0), c.rope_n - 1);
      float* q = big + m * qn;
      rope(q, h + g, dh, c.cos + pos * dh, c.sin + pos * dh);                 // q and k heads
      for (int64_t gg = 0; gg < g; gg++) {
        kv_store(kl + row * ks[2] + gg * ks[3] + slot[m] * ks[4], q + (h + gg) * dh, dh);
        kv_store(kl + ks[1] + row * ks[2] + gg * ks[3] + slot[m] * ks[4], q + (h + g + gg) * dh, dh);
      }
    }
    const int64_t kmax = max_slot + 1, R = M / n;
    // one task per cache row and KV head: its n queries x `rep` query heads attend together, in runs that share
    // their first key (a prefill's pad slots each see only themselves)
    at::parallel_for(0, R * g, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * rep * kmax * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(n * rep, kmax);
      float* scp = buf.sc;
      const float** qs = buf.q;
      float** os = buf.out;
      int64_t* lens = buf.len;
      for (int64_t i = lo; i < hi; i++) {
        const int64_t row = i / g, gg = i % g;
        if (tree) {                                        // the nodes over their kept slots
          const int64_t start = c.lpad[row], t0 = slot[0];
          thread_local std::vector<uint8_t> keep;
          thread_local std::vector<const uint8_t*> kq;
          const int64_t span = kmax - start;
          keep.assign(M * span, 1);
          kq.resize(n * rep);
          for (int64_t m = 0; m < M; m++) {
            uint8_t* km = keep.data() + m * span;
            for (int64_t j = std::max(t0, start); j <= slot[m]; j++) km[j - start] = (tree->anc[m] >> (j - t0)) & 1;
            for (int64_t hh = gg * rep, r = 0; hh < (gg + 1) * rep; hh++, r++) {
              qs[m * rep + r] = big + m * qn + hh * dh;
              os[m * rep + r] = a + m * h * dh + hh * dh;
              lens[m * rep + r] = slot[m] + 1 - start;
              kq[m * rep + r] = km;
            }
          }
          const T* base = kl + row * ks[2] + gg * ks[3] + start * ks[4];
          attend_keep(M * rep, qs, lens, kq.data(), base, base + ks[1], ks[4], scale, os, dh, scp);
          continue;
        }
        int64_t cnt = 0, run_start = -1;
        auto flush = [&]() {
          if (cnt == 0) return;
          const T* base = kl + row * ks[2] + gg * ks[3] + run_start * ks[4];
          attend(cnt, qs, lens, base, base + ks[1], ks[4], nullptr, scale, os, dh, scp);
          cnt = 0;
        };
        for (int64_t j = 0; j < n; j++) {
          const int64_t m = row * n + j;
          const int64_t start = slot[m] >= c.lpad[row] ? c.lpad[row] : slot[m];
          if (start != run_start) { flush(); run_start = start; }
          for (int64_t hh = gg * rep; hh < (gg + 1) * rep; hh++) {
            qs[cnt] = big + m * qn + hh * dh;
            os[cnt] = a + m * h * dh + hh * dh;
            lens[cnt] = slot[m] + 1 - start;
            cnt++;
          }
        }
        flush();
      }
    });
    tk.to(P_DEC_ATT);
    lin_rows(w.o, a, o, M);
    prefetch_lin(w.gate_up, PF_NEXT);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    rms_rows(x, y, M, d, w.n2w.data_ptr<float>(), (float)w.eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.gate_up, y, big, M);                                           // [M][gate F | up F]
    prefetch_lin(w.down, PF_NEXT);
    tk.to(P_DEC_LIN);
    const int64_t f = w.down.K;
    for (int64_t m = 0; m < M; m++) {
      float* gu = big + m * 2 * f;
      float* act = big + m * f;   // in place: row m's outputs overwrite its own or earlier rows' consumed inputs
      silu_gate(gu, gu + f, act, f);
    }
    tk.to(P_DEC_OTHER);
    lin_rows(w.down, big, o, M);
    if (li + 1 < net.layers.size()) prefetch_lin(net.layers[li + 1].qkv, PF_NEXT);
    else if (!net.proj.screen) prefetch_lin(net.proj, PF_NEXT);              // head 1 after the final norm
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    tk.to(P_DEC_OTHER);
  }
}

static void lm_decode_raw(float* x, int64_t M, int64_t n, const int64_t* slot, const LMNet& net, const LMCache& c,
                          const TreeRows* tree = nullptr) {
  if (c.half) lm_decode_raw_t<f16>(x, M, n, slot, net, c, tree);
  else lm_decode_raw_t<float>(x, M, n, slot, net, c, tree);
}

static void lm_head1_ids(const float* h, int64_t M, const LMNet& net, int64_t* out, bool full = false) {
  Work& ws = work();
  const int64_t d = net.d;
  float* y = grow(ws.n1, M * d);
  rms_rows(h, y, M, d, net.nw.data_ptr<float>(), (float)net.eps);
  project_ids(y, M, net.proj, out, full, ws.logits);
}

// chained heads (encdec.h chain_propose) with the model's RMSNorm and its unscaled token embedding
static void lm_propose_chain(const float* h, int64_t M, const LMNet& net, const LMProp& p, int64_t n_heads,
                             const int64_t* first, int64_t* out, float* lg = nullptr) {
  auto lins = [&](int64_t i, int j) -> const Lin& { return p.lins[3 * i + j]; };
  const float* nw = net.nw.data_ptr<float>();
  auto norm = [&](const float* st, float* y, int64_t m) { rms_rows(st, y, m, net.d, nw, (float)net.eps); };
  chain_propose(h, M, net.d, n_heads, lins, net.embed.data_ptr<float>(), net.embed.size(0), 1.0f, norm, p.proj,
                p.draft.defined() ? p.draft.data_ptr<int64_t>() : nullptr, first, out, lg);
}

// heads 1..n_heads at M positions h [M][d] -> ids [M][n_heads] (top_r > 1: each head's top_r best first, [M][n_heads]
// [top_r]); first [M]: head 1's tokens (chained heads read them; they give their top 1 only)
static void lm_propose_raw(const float* h, int64_t M, const LMNet& net, const LMProp& p, int64_t n_heads,
                           int64_t* out, const int64_t* first = nullptr, int64_t top_r = 1, float* lg = nullptr) {
  TORCH_CHECK(n_heads >= 1 && n_heads <= p.n_heads, "propose: ", n_heads, " heads asked of a proposal path for ",
              p.n_heads);
  if (p.kind == 0 && n_heads < p.n_heads) {   // BPD heads' FFN makes every head at once: keep the first n_heads
    thread_local std::vector<int64_t> all;
    thread_local std::vector<float> all_lg;
    all.resize(M * p.n_heads * top_r);
    if (lg) all_lg.resize(M * p.n_heads * p.proj.N);
    lm_propose_raw(h, M, net, p, p.n_heads, all.data(), first, top_r, lg ? all_lg.data() : nullptr);
    const int64_t a = p.n_heads * top_r, b = n_heads * top_r, V = p.proj.N;
    for (int64_t m = 0; m < M; m++) std::copy(all.data() + m * a, all.data() + m * a + b, out + m * b);
    if (lg)
      for (int64_t m = 0; m < M; m++)
        std::copy(all_lg.data() + m * p.n_heads * V, all_lg.data() + (m * p.n_heads + n_heads) * V, lg + m * n_heads * V);
    return;
  }
  TORCH_CHECK(p.kind != 2 || top_r == 1, "propose: chained heads give one proposal per head (no candidate trees)");
  if (p.kind == 2) return lm_propose_chain(h, M, net, p, n_heads, first, out, lg);
  Work& ws = work();
  const int64_t d = net.d;
  const float* nw = net.nw.data_ptr<float>();
  const float eps = (float)net.eps;
  Tick tk;
  float* st = grow(ws.st, M * n_heads * d);
  float* y = grow(ws.sy, M * n_heads * d);
  if (p.kind == 0) {
    const Lin& fc1 = p.lins[0];
    const Lin& fc2 = p.lins[1];
    float* hid = grow(ws.hid, M * fc1.N);
    lin_rows(fc1, h, hid, M);
    for (int64_t i = 0; i < M * fc1.N; i++) hid[i] = std::max(hid[i], 0.0f);
    lin_rows(fc2, hid, st, M);                                               // [M][n_heads][D]
    for (int64_t m = 0; m < M; m++)
      for (int64_t i = 0; i < n_heads * d; i++) st[m * n_heads * d + i] += h[m * d + i % d];
    rms_rows(st, y, M * n_heads, d, nw, eps);
  } else {
    float* nrm = grow(ws.hid, M * d + M * d);
    float* xi = nrm + M * d;
    rms_rows(h, nrm, M, d, nw, eps);
    for (int64_t hh = 0; hh < n_heads; hh++) {
      std::memcpy(xi, nrm, M * d * sizeof(float));
      for (int64_t l = 0; l < p.n_layers; l++) {
        float* t = st;                                                       // scratch [M][d]
        lin_rows(p.lins[hh * p.n_layers + l], xi, t, M);
        for (int64_t m = 0; m < M; m++) silu_add(t + m * d, xi + m * d, d);   // per row: the same split for every row
      }
      for (int64_t m = 0; m < M; m++) std::memcpy(y + (m * n_heads + hh) * d, xi + m * d, d * sizeof(float));
    }
  }
  tk.to(P_HEADS_FFN);
  int64_t* ids = grow(ws.pids, M * n_heads * top_r);
  if (top_r == 1) {
    project_ids(y, M * n_heads, p.proj, ids, lg != nullptr, ws.plog);
    if (lg) std::memcpy(lg, ws.plog.data(), M * n_heads * p.proj.N * sizeof(float));
  } else {
    float* l = grow(ws.plog, M * n_heads * p.proj.N);
    lin_rows(p.proj, y, l, M * n_heads);
    for (int64_t m = 0; m < M * n_heads; m++) top_r_row(l + m * p.proj.N, p.proj.N, top_r, ids + m * top_r);
  }
  const int64_t* dp = p.draft.defined() ? p.draft.data_ptr<int64_t>() : nullptr;
  for (int64_t m = 0; m < M * n_heads * top_r; m++) out[m] = dp ? dp[ids[m]] : ids[m];
  tk.to(P_PROPOSE_PROJ);
}

struct LMLoop : LoopModel {
  const LMNet& net;
  const LMCache c;
  const LMProp* prop = nullptr;
  LMLoop(const LMNet& n, const torch::Tensor& self_kv, const torch::Tensor& lpad, const torch::Tensor& cos,
         const torch::Tensor& sin, const torch::Tensor& stop_ids)
      : net(n), c(self_kv, lpad, cos, sin) {
    d = n.d;
    stops = stop_list(stop_ids);
  }
  void embed(const int64_t* tok, const int64_t*, int64_t M, float* x) const override {
    const float* e = net.embed.data_ptr<float>();
    const int64_t V = net.embed.size(0);
    for (int64_t m = 0; m < M; m++) {
      TORCH_CHECK(tok[m] >= 0 && tok[m] < V, "decode: token id ", tok[m], " outside the vocabulary");
      std::memcpy(x + m * d, e + tok[m] * d, d * sizeof(float));
    }
  }
  void layers(float* x, int64_t M, int64_t n, const int64_t* slot) const override {
    lm_decode_raw(x, M, n, slot, net, c);
  }
  void head1(const float* h, int64_t M, int64_t* out) const override { lm_head1_ids(h, M, net, out, full_logits()); }
  int64_t vocab() const override { return net.proj.N; }
  bool move_row(int64_t dst, int64_t src, int64_t filled) const override {
    c.move_row(dst, src, filled);
    return true;
  }
  void propose(const float* h, int64_t M, int64_t n_heads, const int64_t* first, int64_t* out,
               float* lg = nullptr) const override {
    TORCH_CHECK(prop != nullptr, "propose: no proposal path given");
    lm_propose_raw(h, M, net, *prop, n_heads, out, first, 1, lg);
  }
  int64_t draft_vocab() const override { return prop->proj.N; }
  const int64_t* draft_map() const override { return prop->draft.defined() ? prop->draft.data_ptr<int64_t>() : nullptr; }
  void propose_top(const float* h, int64_t n_heads, int64_t r, int64_t* out) const override {
    TORCH_CHECK(prop != nullptr, "propose: no proposal path given");
    lm_propose_raw(h, 1, net, *prop, n_heads, out, nullptr, r);
  }
  void layers_tree(float* x, int64_t M, const int64_t* slot, const int64_t* pslot, const uint64_t* anc) const override {
    const TreeRows tr{pslot, anc};
    lm_decode_raw(x, M, M, slot, net, c, &tr);
  }
  // cache row 0's K and V at slot dst = those at slot src, every layer and KV head
  void move_slot(int64_t dst, int64_t src) const override {
    const int64_t es = c.half ? 2 : 4;   // bytes an element
    for (int64_t li = 0; li < c.kn[0]; li++)
      for (int64_t kv = 0; kv < 2; kv++)
        for (int64_t gg = 0; gg < c.kn[3]; gg++) {
          char* b = (char*)c.kv + (li * c.ks[0] + kv * c.ks[1] + gg * c.ks[3]) * es;
          std::memcpy(b + dst * c.ks[4] * es, b + src * c.ks[4] * es, c.dh * es);
        }
  }
};

// tokens [R,n] at cache slots [R,n] (each row's own) -> decoder output [R,n,D] before the final norm (LMModel.decode
// and its prefill on the native path)
torch::Tensor lm_decode_layers(const torch::Tensor& tokens, const LMNet& net, const torch::Tensor& self_kv,
                               const torch::Tensor& lpad, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& slots) {
  TORCH_CHECK(tokens.dim() == 2 && slots.sizes() == tokens.sizes(), "lm_decode_layers: tokens and slots [R,n]");
  const int64_t r = tokens.size(0), n = tokens.size(1), M = r * n;
  auto tk = tokens.to(torch::kLong).contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  LMLoop mdl(net, self_kv, lpad, cos, sin, torch::empty({0}, torch::kLong));
  auto x = torch::empty({r, n, net.d}, torch::TensorOptions().dtype(torch::kFloat32));
  mdl.embed(tk.data_ptr<int64_t>(), nullptr, M, x.data_ptr<float>());
  if (M > 0) mdl.layers(x.data_ptr<float>(), M, n, sl.data_ptr<int64_t>());
  return x;
}

torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& w, double eps) {
  auto x = h.to(torch::kFloat32).contiguous();
  auto y = torch::empty_like(x);
  const int64_t d = x.size(-1);
  auto wc = w.contiguous();
  rms_rows(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() / d, d, wc.data_ptr<float>(), (float)eps);
  return y;
}

// head 1's next token: argmax of proj(rms_norm(h)), h [...,D] -> ids [...]
torch::Tensor lm_head1_argmax(const torch::Tensor& h, const LMNet& net) {
  auto x = h.to(torch::kFloat32).contiguous();
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto ids = torch::empty(shape, x.options().dtype(torch::kLong));
  lm_head1_ids(x.data_ptr<float>(), x.numel() / net.d, net, ids.data_ptr<int64_t>());
  return ids;
}

// heads' proposals h [...,D] -> ids [..., n_heads]; first [...]: head 1's tokens (chained heads: required)
torch::Tensor lm_propose(const torch::Tensor& h, const LMNet& net, const LMProp& p,
                         c10::optional<torch::Tensor> first) {
  auto x = h.to(torch::kFloat32).contiguous();
  const int64_t M = x.numel() / net.d;
  auto shape = x.sizes().vec();
  shape.back() = p.n_heads;
  auto ids = torch::empty(shape, x.options().dtype(torch::kLong));
  torch::Tensor f;
  if (first.has_value()) {
    f = first->to(torch::kLong).contiguous();
    TORCH_CHECK(f.numel() == M, "lm_propose: one first token per position (", M, "), got ", f.numel());
  }
  lm_propose_raw(x.data_ptr<float>(), M, net, p, p.n_heads, ids.data_ptr<int64_t>(),
                 f.defined() ? f.data_ptr<int64_t>() : nullptr);
  return ids;
}

// greedy_steps for a decoder-only model: a row ends on any of `stops` (sampled steps where `sampling` is given)
std::tuple<torch::Tensor, torch::Tensor, double> lm_greedy_steps(
    torch::Tensor tok, const LMNet& net, const torch::Tensor& self_kv, const torch::Tensor& lpad,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t t, c10::optional<torch::Tensor> lengths,
    const torch::Tensor& stops, torch::Tensor room, int64_t max_steps, bool to_end,
    c10::optional<torch::Tensor> sampling, c10::optional<torch::Tensor> rng) {
  const auto t_start = std::chrono::steady_clock::now();
  LMLoop mdl(net, self_kv, lpad, cos, sin, stops);
  const auto smp = make_sampler(sampling, rng, tok.size(0));
  return greedy_loop(mdl, tok, first_slots(tok.size(0), t, lengths), room, max_steps, t_start, to_end, smp.get());
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double> lm_block_steps(
    torch::Tensor x_in, const LMNet& net, const LMProp& prop, const torch::Tensor& self_kv, const torch::Tensor& lpad,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t t, const torch::Tensor& stops, int64_t room,
    int64_t max_steps, int64_t group, int64_t width, int64_t top_n, double dist_eps,
    const std::vector<torch::Tensor>& context, int64_t lookup, int64_t narrow, c10::optional<torch::Tensor> tree) {
  const auto t_start = std::chrono::steady_clock::now();
  LMLoop mdl(net, self_kv, lpad, cos, sin, stops);
  mdl.prop = &prop;
  mdl.set_rule(top_n, dist_eps);
  mdl.set_context(context, lookup, narrow);
  mdl.set_tree(tree);
  return block_loop(mdl, x_in, t, room, max_steps, group, width, t_start);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double> lm_batch_block_steps(
    torch::Tensor x_in, const LMNet& net, const LMProp& prop, const torch::Tensor& self_kv, const torch::Tensor& lpad,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t t, torch::Tensor lengths, const torch::Tensor& stops,
    torch::Tensor room, int64_t max_steps, int64_t group, int64_t width, int64_t top_n, double dist_eps,
    bool to_end, const std::vector<torch::Tensor>& context, int64_t lookup, int64_t narrow,
    c10::optional<torch::Tensor> sampling, c10::optional<torch::Tensor> rng, c10::optional<torch::Tensor> tree) {
  const auto t_start = std::chrono::steady_clock::now();
  LMLoop mdl(net, self_kv, lpad, cos, sin, stops);
  mdl.prop = &prop;
  mdl.set_rule(top_n, dist_eps);
  mdl.set_context(context, lookup, narrow);
  if (const auto smp = make_sampler(sampling, rng, x_in.size(0))) {  // blockwise sampling, every row to its end
    mdl.set_tree(tree);                                               // (trees: a call of one row)
    return sample_block_loop(mdl, *smp, x_in.select(1, 0), t, lengths, room, max_steps, group, width, narrow, t_start);
  }
  return batch_block_loop(mdl, x_in, t, lengths, room, max_steps, group, width, t_start, to_end);
}
