// The encoder-decoder model's native pieces: the decoder layer stack of one decode step, the encoder, the
// cross-attention memory, the embedding and the proposal heads (plain and chained).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "attention.h"
#include "screen.h"

// One decoder layer's decode-step weights (pre-norm layer, ReLU FFN: model/layers.py DecoderLayer).
struct StepLayer {
  int64_t n_heads;
  double eps;
  torch::Tensor n1w, n1b, n2w, n2b, n3w, n3b;
  Lin qkv, so, q, co, f1, f2;
  StepLayer(int64_t h, double e, torch::Tensor a, torch::Tensor b, Lin l1, Lin l2, torch::Tensor c, torch::Tensor d,
            Lin l3, Lin l4, torch::Tensor e3, torch::Tensor f, Lin l5, Lin l6)
      : n_heads(h), eps(e), n1w(a), n1b(b), n2w(c), n2b(d), n3w(e3), n3b(f), qkv(l1), so(l2), q(l3), co(l4), f1(l5),
        f2(l6) {}
};

// ---- the decoder stack for a decode step, without ATen ops ----
// model/layers.py decode_step (pre-norm, ReLU) for every layer in one call, on raw buffers: at decoding sizes
// the ATen ops of a layer (dispatch, allocation, SDPA's setup) cost far more than their arithmetic. Every row is
// computed by the same code whatever the batch or the number of tokens fed: layer norm, the packed linears and
// attention (each query's own arithmetic, slots in order), so a token's decoder output is bit-identical alone
// (greedy) or inside a block (blockwise verification) — which torch's SDPA did not guarantee. Results differ from
// the torch path (model/layers.py) by rounding only.

// Cache row dst = cache row src of a [L,2,R,H,slots,Dh] cache (strides st, sizes n), its first `slots` slots
template <typename T>
static void move_cache_row(T* base, const int64_t* st, const int64_t* n, int64_t dst, int64_t src, int64_t slots) {
  for (int64_t a = 0; a < n[0]; a++)
    for (int64_t b = 0; b < n[1]; b++)
      for (int64_t hh = 0; hh < n[3]; hh++) {
        T* to = base + a * st[0] + b * st[1] + dst * st[2] + hh * st[3];
        const T* from = base + a * st[0] + b * st[1] + src * st[2] + hh * st[3];
        if (st[4] == n[5]) std::memcpy(to, from, slots * n[5] * sizeof(T));
        else for (int64_t j = 0; j < slots; j++) std::memcpy(to + j * st[4], from + j * st[4], n[5] * sizeof(T));
      }
}

// The cache a decode step reads and writes (model/cache.py layout): self [L,2,R,H,cap,Dh], memory
// [L,2,R/G,H,S,Dh], additive memory mask [R/G,S] or none.
struct Cache {
  float* kv;
  float* mk;
  float* mm;
  int64_t ks[6], ms[6], kn[6], mn[6], cap, S, g;
  torch::Tensor mask_keep;
  Cache(const torch::Tensor& self_kv, const torch::Tensor& mem_kv, const c10::optional<torch::Tensor>& mem_mask,
        int64_t g_) : g(g_) {
    TORCH_CHECK(self_kv.scalar_type() == torch::kFloat32 && mem_kv.scalar_type() == torch::kFloat32,
                "decode: float32 caches only");
    for (int i = 0; i < 6; i++) {
      ks[i] = self_kv.stride(i);
      ms[i] = mem_kv.stride(i);
      kn[i] = self_kv.size(i);
      mn[i] = mem_kv.size(i);
    }
    TORCH_CHECK(ks[5] == 1 && ms[5] == 1, "decode: caches must be contiguous in the head dimension");
    kv = self_kv.data_ptr<float>();
    mk = mem_kv.data_ptr<float>();
    cap = self_kv.size(4);
    S = mem_kv.size(4);
    mm = nullptr;
    if (mem_mask.has_value()) {
      mask_keep = mem_mask->to(torch::kFloat32).contiguous();
      TORCH_CHECK(mask_keep.numel() == mem_kv.size(2) * S, "decode: memory mask must be [R/G,1,1,S]");
      mm = mask_keep.data_ptr<float>();
    }
  }
  // row dst of the caches = row src (self cache: its first `filled` slots), rows not sharing memory (g == 1)
  void move_row(int64_t dst, int64_t src, int64_t filled) const {
    TORCH_CHECK(g == 1, "move_row: rows share memory rows");
    move_cache_row(kv, ks, kn, dst, src, filled);
    move_cache_row(mk, ms, mn, dst, src, S);
    if (mm) std::memcpy(mm + dst * S, mm + src * S, S * sizeof(float));
  }
};

// x [M][d] (embedded tokens, in place -> decoder output before the final norm); row m is cache row m / n and
// writes its K/V at slot[m]; a query at slot p sees slots 0..p (the causal and per-row masks of model/cache.py).
static void decode_raw(float* x, int64_t M, int64_t n, int64_t d, const int64_t* slot,
                       const std::vector<StepLayer>& layers, const Cache& c) {
  Work& ws = work();
  int64_t ff = 0, max_slot = 0;
  for (const auto& w : layers) ff = std::max(ff, w.f1.N);
  for (int64_t m = 0; m < M; m++) max_slot = std::max(max_slot, slot[m]);
  TORCH_CHECK(max_slot < c.cap, "KV cache capacity ", c.cap, " exceeded (needs ", max_slot + 1, ")");
  float* y = grow(ws.y, M * d);
  float* big = grow(ws.big, M * std::max<int64_t>(3 * d, ff));
  float* a = grow(ws.a, M * d);
  float* o = grow(ws.o, M * d);
  const int64_t* ks = c.ks;
  const int64_t* ms = c.ms;
  const int64_t S = c.S, g = c.g;
  Tick tk;
  for (size_t li = 0; li < layers.size(); li++) {
    const StepLayer& w = layers[li];
    const int64_t h = w.n_heads, dh = d / h;
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    const float eps = (float)w.eps;
    // self-attention
    norm_rows(x, y, M, d, w.n1w.data_ptr<float>(), w.n1b.data_ptr<float>(), eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.qkv, y, big, M);                                               // [M][3][H][Dh]
    tk.to(P_DEC_LIN);
    float* kl = c.kv + li * ks[0];
    for (int64_t m = 0; m < M; m++) {
      const int64_t row = m / n;
      for (int64_t hh = 0; hh < h; hh++) {
        const float* src = big + m * 3 * d + hh * dh;
        std::memcpy(kl + row * ks[2] + hh * ks[3] + slot[m] * ks[4], src + d, dh * sizeof(float));
        std::memcpy(kl + ks[1] + row * ks[2] + hh * ks[3] + slot[m] * ks[4], src + 2 * d, dh * sizeof(float));
      }
    }
    const int64_t kmax = max_slot + 1, R = M / n;
    // one task per cache row and head: the row's n queries (a blockwise step's tokens) attend together
    at::parallel_for(0, R * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * kmax * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(n, kmax);
      float* scp = buf.sc;
      const float** qs = buf.q;
      float** os = buf.out;
      int64_t* lens = buf.len;
      for (int64_t i = lo; i < hi; i++) {
        const int64_t row = i / h, hh = i % h;
        for (int64_t j = 0; j < n; j++) {
          const int64_t m = row * n + j;
          qs[j] = big + m * 3 * d + hh * dh;
          os[j] = a + m * d + hh * dh;
          lens[j] = slot[m] + 1;
        }
        const float* base = kl + row * ks[2] + hh * ks[3];
        attend(n, qs, lens, base, base + ks[1], ks[4], nullptr, scale, os, dh, scp);
      }
    });
    tk.to(P_DEC_ATT);
    lin_rows(w.so, a, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    // cross-attention: row `row` reads memory row row / g
    norm_rows(x, y, M, d, w.n2w.data_ptr<float>(), w.n2b.data_ptr<float>(), eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.q, y, o, M);
    tk.to(P_DEC_LIN);
    const float* ml = c.mk + li * ms[0];
    const float* mm = c.mm;
    at::parallel_for(0, R * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * S * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(n, S);
      float* scp = buf.sc;
      const float** qs = buf.q;
      float** os = buf.out;
      int64_t* lens = buf.len;
      for (int64_t i = lo; i < hi; i++) {
        const int64_t row = i / h, hh = i % h, b = row / g;
        for (int64_t j = 0; j < n; j++) {
          const int64_t m = row * n + j;
          qs[j] = o + m * d + hh * dh;
          os[j] = a + m * d + hh * dh;
          lens[j] = S;
        }
        const float* base = ml + b * ms[2] + hh * ms[3];
        attend(n, qs, lens, base, base + ms[1], ms[4], mm ? mm + b * S : nullptr, scale, os, dh, scp);
      }
    });
    tk.to(P_DEC_ATT);
    lin_rows(w.co, a, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    // feed-forward
    norm_rows(x, y, M, d, w.n3w.data_ptr<float>(), w.n3b.data_ptr<float>(), eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.f1, y, big, M);
    for (int64_t i = 0; i < M * w.f1.N; i++) big[i] = std::max(big[i], 0.0f);
    lin_rows(w.f2, big, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    tk.to(P_DEC_OTHER);
  }
}

// write_index: per-row slots [2,R,H,n,Dh] (its [0,r,0,j,0] is token j's slot in row r; per-row cache mode),
// else token j goes to slot t + j of every row (uniform mode). self_mask is not read (decode_raw's rule is
// the same mask).
torch::Tensor decode_layers(torch::Tensor x_in, const std::vector<StepLayer>& layers, const torch::Tensor& self_kv,
                            const torch::Tensor& mem_kv, c10::optional<torch::Tensor> self_mask,
                            c10::optional<torch::Tensor> mem_mask, c10::optional<torch::Tensor> write_index, int64_t t,
                            int64_t kv_len, int64_t g) {
  (void)self_mask; (void)kv_len;
  const int64_t r = x_in.size(0), n = x_in.size(1), d = x_in.size(2), M = r * n;
  auto x_t = x_in.to(torch::kFloat32).contiguous().clone();
  std::vector<int64_t> slot(M);
  if (write_index.has_value()) {
    auto si = write_index->select(0, 0).select(1, 0).select(2, 0).contiguous();   // [R,n]
    const int64_t* sp = si.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; m++) slot[m] = sp[m];
  } else {
    for (int64_t m = 0; m < M; m++) slot[m] = t + m % n;
  }
  Cache c(self_kv, mem_kv, mem_mask, g);
  decode_raw(x_t.data_ptr<float>(), M, n, d, slot.data(), layers, c);
  return x_t;
}

// ---- the encoder for decoding, without ATen ops ----
// One encoder layer's weights (pre-norm layer, ReLU FFN: model/layers.py EncoderLayer).
struct EncLayer {
  int64_t n_heads;
  double eps;
  torch::Tensor n1w, n1b, n2w, n2b;
  Lin qkv, so, f1, f2;
  EncLayer(int64_t h, double e, torch::Tensor a, torch::Tensor b, Lin l1, Lin l2, torch::Tensor c, torch::Tensor d,
           Lin l3, Lin l4)
      : n_heads(h), eps(e), n1w(a), n1b(b), n2w(c), n2b(d), qkv(l1), so(l2), f1(l3), f2(l4) {}
};

// model/transformer.py encode at inference (pre-norm ReLU layers, then the final norm where there is one) on raw
// buffers: at batch 1 the encoder's ATen ops cost more than its arithmetic. x [B,S,d] the embedded sources; mask
// [B,S] additive (0 / -inf on padding) or none. Every query attends over all S keys (minus padding). The encoder is
// the same for every decoder, so its rounding (not torch's) is what greedy, blockwise and beam decoding all read.
static void encode_raw(float* x, int64_t B, int64_t S, int64_t d, const float* mm, const std::vector<EncLayer>& layers,
                       const c10::optional<torch::Tensor>& fnw, const c10::optional<torch::Tensor>& fnb, double feps) {
  const int64_t M = B * S;
  Work& ws = work();
  int64_t ff = 0;
  for (const auto& w : layers) ff = std::max(ff, w.f1.N);
  float* y = grow(ws.y, M * d);
  float* big = grow(ws.big, M * std::max<int64_t>(3 * d, ff));
  float* a = grow(ws.a, M * d);
  float* o = grow(ws.o, M * d);
  for (const EncLayer& w : layers) {
    const int64_t h = w.n_heads, dh = d / h;
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    norm_rows(x, y, M, d, w.n1w.data_ptr<float>(), w.n1b.data_ptr<float>(), (float)w.eps);
    lin_rows(w.qkv, y, big, M);                                               // [B][S][3][H][Dh]
    // one task per source and head: its S queries over its S keys
    at::parallel_for(0, B * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, S * S * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(S, S);
      for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i / h, hh = i % h;
        for (int64_t j = 0; j < S; j++) {
          buf.q[j] = big + (b * S + j) * 3 * d + hh * dh;
          buf.out[j] = a + (b * S + j) * d + hh * dh;
          buf.len[j] = S;
        }
        const float* kb = big + b * S * 3 * d + d + hh * dh;
        attend(S, buf.q, buf.len, kb, kb + d, 3 * d, mm ? mm + b * S : nullptr, scale, buf.out, dh, buf.sc);
      }
    });
    lin_rows(w.so, a, o, M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    norm_rows(x, y, M, d, w.n2w.data_ptr<float>(), w.n2b.data_ptr<float>(), (float)w.eps);
    lin_rows(w.f1, y, big, M);
    for (int64_t i = 0; i < M * w.f1.N; i++) big[i] = std::max(big[i], 0.0f);
    lin_rows(w.f2, big, o, M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
  }
  if (fnw.has_value()) {
    norm_rows(x, y, M, d, fnw->data_ptr<float>(), fnb->data_ptr<float>(), (float)feps);
    std::memcpy(x, y, M * d * sizeof(float));
  }
}

// The encoder from the source ids [B,S] (right-padded with pad_id): the embedding as BPDModel._embed computes it
// (table[id] * scale, then + pe[position], two roundings) and the padding mask (none where nothing is padded, as
// BPDModel.encode passes), so a batch-1 call skips the ATen ops (and their Python) around the encoder.
// Returns (encoder output [B,S,d], whether any source is padded).
std::tuple<torch::Tensor, bool> encode_ids(torch::Tensor ids_in, torch::Tensor table, double scale, torch::Tensor pe, int64_t pad_id,
                         const std::vector<EncLayer>& layers, c10::optional<torch::Tensor> fnw,
                         c10::optional<torch::Tensor> fnb, double feps) {
  TORCH_CHECK(ids_in.dim() == 2, "encode_ids: ids must be [B,S]");
  TORCH_CHECK(table.is_contiguous() && pe.is_contiguous() && table.scalar_type() == torch::kFloat32 &&
              pe.scalar_type() == torch::kFloat32 && pe.size(1) == table.size(1), "encode_ids: fp32 tables");
  const auto ids_t = ids_in.to(torch::kLong).contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const int64_t B = ids_t.size(0), S = ids_t.size(1), d = table.size(1), V = table.size(0);
  TORCH_CHECK(S <= pe.size(0), "encode_ids: source longer than the position table");
  auto x_t = torch::empty({B, S, d}, table.options());
  float* x = x_t.data_ptr<float>();
  const float* e = table.data_ptr<float>();
  const float* pp = pe.data_ptr<float>();
  const float sc = (float)scale;
  bool padded = false;
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = 0; j < S; j++) {
      const int64_t id = ids[b * S + j];
      TORCH_CHECK(id >= 0 && id < V, "encode_ids: token id ", id, " outside the vocabulary of ", V);
      padded |= id == pad_id;
      const float* er = e + id * d;
      const float* pr = pp + j * d;
      float* xr = x + (b * S + j) * d;
      for (int64_t i = 0; i < d; i++) {
        const float v = er[i] * sc;
        xr[i] = v + pr[i];
      }
    }
  std::vector<float> mask;
  if (padded) {
    mask.assign(B * S, 0.0f);
    for (int64_t i = 0; i < B * S; i++)
      if (ids[i] == pad_id) mask[i] = -std::numeric_limits<float>::infinity();
  }
  encode_raw(x, B, S, d, padded ? mask.data() : nullptr, layers, fnw, fnb, feps);
  return {x_t, padded};
}

// Each decoder layer's cross-attention keys and values of the encoder output (BPDModel.start_decoding): out
// [B,S,d], kv[l] the layer's packed [2d, d] projection. Returns mem_kv [L,2,B,H,S,Dh] (model/cache.py's layout).
torch::Tensor memory_kv(torch::Tensor out_in, const std::vector<Lin>& kv, int64_t n_heads) {
  const int64_t B = out_in.size(0), S = out_in.size(1), d = out_in.size(2), M = B * S, Ln = (int64_t)kv.size();
  const int64_t dh = d / n_heads;
  auto xin = out_in.to(torch::kFloat32).contiguous();
  auto res = torch::empty({Ln, 2, B, n_heads, S, dh}, xin.options());
  float* r = res.data_ptr<float>();
  float* tmp = grow(work().big, M * 2 * d);
  for (int64_t l = 0; l < Ln; l++) {
    lin_rows(kv[l], xin.data_ptr<float>(), tmp, M);                          // [B][S][2][H][Dh]
    for (int64_t m = 0; m < M; m++) {
      const int64_t b = m / S, s = m % S;
      for (int64_t t = 0; t < 2; t++)
        for (int64_t hh = 0; hh < n_heads; hh++)
          std::memcpy(r + ((((l * 2 + t) * B + b) * n_heads + hh) * S + s) * dh, tmp + m * 2 * d + t * d + hh * dh,
                      dh * sizeof(float));
    }
  }
  return res;
}

// The embedding a decode step feeds, as BPDModel.decode computes it: embed[tok] * scale, then + pe[pos], two
// roundings (the extension is built with -ffp-contract=off, so no fused multiply-add merges them).
struct Embed {
  const float* e;
  const float* pe;
  float scale;
  int64_t d, max_pos;
  Embed(const torch::Tensor& embed, double s, const torch::Tensor& pe_, int64_t mp)
      : e(embed.data_ptr<float>()), pe(pe_.data_ptr<float>()), scale((float)s), d(embed.size(1)), max_pos(mp) {
    TORCH_CHECK(embed.is_contiguous() && pe_.is_contiguous() && embed.scalar_type() == torch::kFloat32 &&
                pe_.scalar_type() == torch::kFloat32, "embedding tables must be contiguous float32");
  }
  void rows(const int64_t* tok, const int64_t* slot, int64_t M, float* x) const {
    for (int64_t m = 0; m < M; m++) {
      const float* er = e + tok[m] * d;
      const float* pr = pe + std::min(slot[m], max_pos - 1) * d;
      float* xr = x + m * d;
      for (int64_t i = 0; i < d; i++) {
        const float v = er[i] * scale;
        xr[i] = v + pr[i];
      }
    }
  }
};

// Heads lo..lo+n_heads-1 at M positions h [M][D] -> argmax ids [M][n_heads] (draft ids mapped back; lg: their
// logits too, [M][n_heads][proj.N]):
// state_i = h + fc2(relu(fc1(h)))[slice i]; logits = proj(layer_norm(state_i)). Proposals only decide what is
// verified, so their rounding never reaches the output.
static void propose_raw(const float* h, int64_t M, int64_t d, const Lin& fc1, const Lin& fc2, int64_t n_heads,
                        const float* nw, const float* nb, float eps, const Lin& proj, const int64_t* draft,
                        int64_t* out, float* lg = nullptr) {
  Work& ws = work();
  Tick tk;
  float* hid = grow(ws.hid, M * fc1.N);
  float* st = grow(ws.st, M * n_heads * d);
  float* y = grow(ws.sy, M * n_heads * d);
  int64_t* ids = grow(ws.pids, M * n_heads);
  lin_rows(fc1, h, hid, M);
  for (int64_t i = 0; i < M * fc1.N; i++) hid[i] = std::max(hid[i], 0.0f);
  lin_rows(fc2, hid, st, M);                                                 // [M][n_heads][D]
  for (int64_t m = 0; m < M; m++)
    for (int64_t i = 0; i < n_heads * d; i++) st[m * n_heads * d + i] += h[m * d + i % d];
  norm_rows(st, y, M * n_heads, d, nw, nb, eps);
  tk.to(P_HEADS_FFN);
  project_ids(y, M * n_heads, proj, ids, lg != nullptr, ws.plog);
  if (lg) std::memcpy(lg, ws.plog.data(), M * n_heads * proj.N * sizeof(float));
  for (int64_t m = 0; m < M * n_heads; m++) out[m] = draft ? draft[ids[m]] : ids[m];
  tk.to(P_PROPOSE_PROJ);
}

// Chained heads (model/heads.py ChainHeads): head i reads the decoder state h and the embedding of the token before
// its own -- head 1's token for head 2, then each head's own argmax for the next -- through its own FFN:
// x = h + tok_i(emb[prev] * scale), state_i = h + fc2_i(relu(fc1_i(x))), logits = proj(layer_norm(state_i)).
struct ChainProp {
  std::vector<Lin> tok, fc1, fc2;            // heads 2..k: P_i (no bias), W1_i, W2_i
  torch::Tensor emb;                         // [V][D] float32: the decoder's token embedding
  float scale;
  ChainProp(std::vector<Lin> t, std::vector<Lin> f1, std::vector<Lin> f2, torch::Tensor e, double s)
      : tok(std::move(t)), fc1(std::move(f1)), fc2(std::move(f2)), emb(e.contiguous()), scale((float)s) {
    TORCH_CHECK(tok.size() == fc1.size() && tok.size() == fc2.size(), "ChainProp: one tok, fc1, fc2 per head");
    TORCH_CHECK(emb.scalar_type() == torch::kFloat32 && emb.dim() == 2, "ChainProp: emb must be float32 [V, D]");
  }
};

// Chained heads 1..n_heads of either model family at M positions h [M][d], first [M] the token before head 1's target
// (head 0's, i.e. the base model's next token) -> argmax ids [M][n_heads] (draft ids mapped back). lins(i, j): head
// i's token map (j = 0), FFN in (1) and out (2); emb [V][d] the token embedding they read (times scale); norm(st, y,
// M): the model's final norm. lg: each head's logits too, [M][n_heads][proj.N].
template <typename Lins, typename Norm>
static void chain_propose(const float* h, int64_t M, int64_t d, int64_t n_heads, Lins lins, const float* emb,
                          int64_t V, float scale, Norm norm, const Lin& proj, const int64_t* draft,
                          const int64_t* first, int64_t* out, float* lg = nullptr) {
  TORCH_CHECK(first != nullptr, "propose: chained heads need head 1's tokens");
  Work& ws = work();
  Tick tk;
  float* e = grow(ws.ce, M * d);
  float* x = grow(ws.cx, M * d);
  float* st = grow(ws.st, M * d);
  float* y = grow(ws.sy, M * d);
  int64_t* ids = grow(ws.pids, M);
  int64_t* prev = grow(ws.cprev, M);
  std::memcpy(prev, first, M * sizeof(int64_t));
  for (int64_t i = 0; i < n_heads; i++) {
    const Lin &P = lins(i, 0), &F1 = lins(i, 1), &F2 = lins(i, 2);
    float* hid = grow(ws.hid, M * F1.N);
    for (int64_t m = 0; m < M; m++) {
      TORCH_CHECK(prev[m] >= 0 && prev[m] < V, "propose: token id ", prev[m], " outside the vocabulary");
      const float* er = emb + prev[m] * d;
      for (int64_t j = 0; j < d; j++) e[m * d + j] = er[j] * scale;
    }
    lin_rows(P, e, x, M);                                                    // [M][d]
    for (int64_t j = 0; j < M * d; j++) x[j] += h[j];
    lin_rows(F1, x, hid, M);                                                 // [M][H]
    for (int64_t j = 0; j < M * F1.N; j++) hid[j] = std::max(hid[j], 0.0f);
    lin_rows(F2, hid, st, M);                                                // [M][d]
    for (int64_t j = 0; j < M * d; j++) st[j] += h[j];
    norm(st, y, M);
    tk.to(P_HEADS_FFN);
    project_ids(y, M, proj, ids, lg != nullptr, ws.plog);
    if (lg)
      for (int64_t m = 0; m < M; m++)
        std::memcpy(lg + (m * n_heads + i) * proj.N, ws.plog.data() + m * proj.N, proj.N * sizeof(float));
    for (int64_t m = 0; m < M; m++) out[m * n_heads + i] = prev[m] = draft ? draft[ids[m]] : ids[m];
    tk.to(P_PROPOSE_PROJ);
  }
}

static void propose_chain_raw(const float* h, int64_t M, int64_t d, const ChainProp& c, const int64_t* first,
                              int64_t n_heads, const float* nw, const float* nb, float eps, const Lin& proj,
                              const int64_t* draft, int64_t* out, float* lg = nullptr) {
  TORCH_CHECK(n_heads <= (int64_t)c.tok.size(), "propose: ", n_heads, " heads asked of ", c.tok.size(), " chained heads");
  auto lins = [&](int64_t i, int j) -> const Lin& { return j == 0 ? c.tok[i] : j == 1 ? c.fc1[i] : c.fc2[i]; };
  auto norm = [&](const float* st, float* y, int64_t m) { norm_rows(st, y, m, d, nw, nb, eps); };
  chain_propose(h, M, d, n_heads, lins, c.emb.data_ptr<float>(), c.emb.size(0), c.scale, norm, proj, draft, first, out,
                lg);
}

torch::Tensor propose_chain(const torch::Tensor& h_in, const torch::Tensor& first_in, const ChainProp& c,
                            int64_t n_heads, const torch::Tensor& nw, const torch::Tensor& nb, double eps,
                            const Lin& proj, c10::optional<torch::Tensor> draft_ids) {
  const int64_t d = h_in.size(-1);
  auto h_t = h_in.to(torch::kFloat32).contiguous();
  const int64_t M = h_t.numel() / d;
  auto first = first_in.to(torch::kLong).contiguous();
  TORCH_CHECK(first.numel() == M, "propose_chain: one first token per position (", M, "), got ", first.numel());
  auto shape = h_t.sizes().vec();
  shape.back() = n_heads;
  auto ids = torch::empty(shape, h_t.options().dtype(torch::kLong));
  torch::Tensor dids;
  if (draft_ids.has_value()) dids = draft_ids->to(torch::kLong).contiguous();
  propose_chain_raw(h_t.data_ptr<float>(), M, d, c, first.data_ptr<int64_t>(), n_heads, nw.data_ptr<float>(),
                    nb.data_ptr<float>(), (float)eps, proj, dids.defined() ? dids.data_ptr<int64_t>() : nullptr,
                    ids.data_ptr<int64_t>());
  return ids;
}

torch::Tensor propose(const torch::Tensor& h_in, const Lin& fc1, const Lin& fc2, int64_t n_heads,
                      const torch::Tensor& nw, const torch::Tensor& nb, double eps, const Lin& proj,
                      c10::optional<torch::Tensor> draft_ids) {
  const int64_t d = h_in.size(-1);
  auto h_t = h_in.to(torch::kFloat32).contiguous();
  const int64_t M = h_t.numel() / d;
  auto shape = h_t.sizes().vec();
  shape.back() = n_heads;
  auto ids = torch::empty(shape, h_t.options().dtype(torch::kLong));
  torch::Tensor dids;
  if (draft_ids.has_value()) dids = draft_ids->to(torch::kLong).contiguous();
  propose_raw(h_t.data_ptr<float>(), M, d, fc1, fc2, n_heads, nw.data_ptr<float>(), nb.data_ptr<float>(), (float)eps,
              proj, dids.defined() ? dids.data_ptr<int64_t>() : nullptr, ids.data_ptr<int64_t>());
  return ids;
}
