// Few-row linear layers for CPU decoding: y[M,N] = x[M,K] . W[N,K]^T (+ b), with W prepacked once.
//
// Why our own kernel: a decode step multiplies 1..k*rows activation rows by every weight matrix. On the
// CPUs we measured, BLAS/oneDNN fp32 GEMM with so few rows runs well below the memory bound and its cost
// grows with the number of rows, so a k-token blockwise call costs 2-4 one-token calls. Here W is packed
// into [N/64][K][64] blocks read in one linear stream (the hardware prefetcher's best case); each block is
// multiplied by up to 4 activation rows at once (16 vector accumulators, no horizontal sums), so k rows cost
// about what one row costs until the core runs out of FMA throughput.
//
// Exactness: output (m, n) is always computed by the same instruction sequence (one FMA per k, in order),
// whatever M, the row blocking or the thread count.
// So a row gives bit-identical logits alone (greedy) or inside a k-row block (blockwise verification),
// and exact blockwise decoding is greedy decoding to the last bit, not just to the argmax.
//
// Weight formats: fp32; bf16 (upper half of the fp32 bits, upconverted exactly in registers); int8 with one
// fp32 scale per output row (weight-only quantisation: activations stay fp32).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <tuple>

namespace {

constexpr int L = 16;        // lanes per vector
constexpr int NV = 4;        // output vectors per block: NB = 64 outputs (weight rows) per block
constexpr int NB = NV * L;
constexpr int MB = 4;        // activation rows per register block (4 x 4 accumulators)

enum Mode { F32 = 0, BF16 = 1, I8 = 2 };

#if defined(__AVX512F__)
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf wload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf wload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vf wload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#define BPD_NATIVE_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
// 16 lanes as two 8-lane halves: same per-lane arithmetic order as the AVX-512 build.
struct vf { __m256 lo, hi; };
static inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline vf vbcast(const float* p) { __m256 v = _mm256_broadcast_ss(p); return {v, v}; }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline vf wload(const float* p) { return vload(p); }
static inline __m256 bf8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf wload(const uint16_t* p) { return {bf8(p), bf8(p + 8)}; }
static inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf wload(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
#define BPD_NATIVE_ISA "avx2"
#else
#error "bpd_train native decode kernels need AVX2+FMA or AVX-512 (the Python side falls back to torch)"
#endif

// One register block: rows x[0..R) times one packed block of NB weight rows ([K][NB] floats). Output lane
// (i, n) accumulates x[i,k] * w[n,k] over k = 0..K-1 in order with one FMA each: the same sequence for
// every row whatever R, so results never depend on the batch a row is decoded in.
template <int R, typename W>
static inline void block(const float* x, int64_t K, const W* w, float* out /* [R][NB] */) {
  vf acc[R][NV];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NV; j++) acc[i][j] = vzero();
  for (int64_t k = 0; k < K; k++) {
    const W* wk = w + k * NB;
    vf wv[NV];
    for (int j = 0; j < NV; j++) wv[j] = wload(wk + j * L);
    for (int i = 0; i < R; i++) {
      const vf xv = vbcast(x + i * K + k);
      for (int j = 0; j < NV; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NV; j++) vstore(out + i * NB + j * L, acc[i][j]);
}

template <typename W>
static void run(const float* x, const W* w, const float* scale, const float* bias, float* y, int64_t M,
                int64_t N, int64_t K) {
  const int64_t nblocks = (N + NB - 1) / NB;
  // split over output blocks only: every output is computed the same way whatever the thread count
  const int64_t work = std::max<int64_t>(1, K * NB * std::max<int64_t>(M, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t)(1 << 17) / work);
  at::parallel_for(0, nblocks, grain, [&](int64_t lo, int64_t hi) {
    alignas(64) float out[MB * NB];
    for (int64_t nb = lo; nb < hi; nb++) {
      const W* wb = w + nb * NB * K;
      const int64_t n0 = nb * NB;
      const int nn = (int)std::min<int64_t>(NB, N - n0);
      for (int64_t m = 0; m < M;) {
        int r;
        if (M - m >= MB) { block<MB>(x + m * K, K, wb, out); r = MB; }
        else { block<1>(x + m * K, K, wb, out); r = 1; }
        for (int i = 0; i < r; i++) {
          float* yr = y + (m + i) * N + n0;
          const float* o = out + i * NB;
          for (int j = 0; j < nn; j++) {
            float s = o[j];
            if (scale) s *= scale[n0 + j];
            if (bias) s += bias[n0 + j];
            yr[j] = s;
          }
        }
        m += r;
      }
    }
  });
}

}  // namespace

// w [N,K] float32 -> packed [N/64, K, 64] (rows zero-padded to a multiple of 64) in the requested format;
// int8 also returns per-row scales (max |w| / 127).
std::vector<torch::Tensor> pack(torch::Tensor w, int64_t mode) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack: w must be a 2-D float32 tensor");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t Np = (N + NB - 1) / NB * NB;
  auto wp = torch::zeros({Np, K}, w.options());
  wp.narrow(0, 0, N).copy_(w);
  torch::Tensor scale;
  torch::Tensor src = wp;
  if (mode == I8) {
    scale = wp.abs().amax(1).div_(127.0f).clamp_min_(1e-30f);
    src = torch::round(wp / scale.unsqueeze(1)).clamp_(-127, 127);
  }
  auto blocked = src.view({Np / NB, NB, K}).transpose(1, 2).contiguous();  // [Np/NB, K, NB]
  torch::Tensor out;
  if (mode == F32) out = blocked;
  else if (mode == BF16) out = blocked.to(torch::kBFloat16).view(torch::kInt16);
  else if (mode == I8) out = blocked.to(torch::kInt8);
  else TORCH_CHECK(false, "pack: unknown mode ", mode);
  if (mode == I8) return {out, scale.narrow(0, 0, N).contiguous()};
  return {out};
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> scale,
                     c10::optional<torch::Tensor> bias, int64_t N, int64_t K, int64_t mode) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.size(-1) == K, "linear: x must be float32 [..., K]");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* sp = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M > 0) {
    if (mode == F32) run(xp, packed.data_ptr<float>(), nullptr, bp, yp, M, N, K);
    else if (mode == BF16) run(xp, (const uint16_t*)packed.data_ptr<int16_t>(), nullptr, bp, yp, M, N, K);
    else run(xp, packed.data_ptr<int8_t>(), sp, bp, yp, M, N, K);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// A packed linear layer as one object (what model/fastlinear.py PackedLinear holds), so that the fused
// step functions below can chain several of them without returning to Python between ops.
struct Lin {
  torch::Tensor data;
  c10::optional<torch::Tensor> scale, bias;
  int64_t N, K, mode;
  Lin(torch::Tensor d, c10::optional<torch::Tensor> s, c10::optional<torch::Tensor> b, int64_t n, int64_t k, int64_t md)
      : data(std::move(d)), scale(std::move(s)), bias(std::move(b)), N(n), K(k), mode(md) {}
  torch::Tensor operator()(const torch::Tensor& x) const { return linear(x, data, scale, bias, N, K, mode); }
};

// argmax over the vocabulary of proj(layer_norm(h)): head 1's next token (greedy, exact verification).
torch::Tensor norm_project_argmax(const torch::Tensor& h, const torch::Tensor& nw, const torch::Tensor& nb, double eps,
                                  const Lin& proj) {
  auto y = at::layer_norm(h, {h.size(-1)}, nw, nb, eps);
  return proj(y).argmax(-1);
}

// The proposal pass: heads lo..hi-1 at positions h [...,D] -> argmax ids [..., n_heads] (draft ids mapped back):
// state_i = h + fc2(relu(fc1(h)))[slice i]; logits = proj(layer_norm(state_i)).
torch::Tensor propose(const torch::Tensor& h, const Lin& fc1, const Lin& fc2, int64_t n_heads,
                      const torch::Tensor& nw, const torch::Tensor& nb, double eps, const Lin& proj,
                      c10::optional<torch::Tensor> draft_ids) {
  const int64_t d = h.size(-1);
  auto out = fc2(at::relu(fc1(h)));
  auto shape = h.sizes().vec();
  shape.push_back(d);
  shape[shape.size() - 2] = n_heads;                      // [..., n_heads, D]
  auto s = h.unsqueeze(-2) + out.view(shape);
  auto ids = proj(at::layer_norm(s, {d}, nw, nb, eps)).argmax(-1);
  if (draft_ids.has_value()) ids = draft_ids->take(ids);
  return ids;
}

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

// model/layers.py decode_step for every layer in one call (the per-op Python overhead of ~20 small ops per
// layer costs more than their arithmetic at decoding sizes). Same ops, same order, same kernels: the results
// are those of the Python path. write_index: per-row slots [2,R,H,n,Dh] to scatter the new K/V into
// (per-row cache mode), else they go to slots [t, t+n) of every row (uniform mode).
torch::Tensor decode_layers(torch::Tensor x, const std::vector<StepLayer>& layers, const torch::Tensor& self_kv,
                            const torch::Tensor& mem_kv, c10::optional<torch::Tensor> self_mask,
                            c10::optional<torch::Tensor> mem_mask, c10::optional<torch::Tensor> write_index, int64_t t,
                            int64_t kv_len, int64_t g) {
  const int64_t r = x.size(0), n = x.size(1), d = x.size(2);
  for (size_t i = 0; i < layers.size(); i++) {
    const StepLayer& w = layers[i];
    const int64_t h = w.n_heads, dh = d / h;
    auto kv = self_kv.select(0, i);                                        // [2,R,H,L,Dh]
    auto y = at::layer_norm(x, {d}, w.n1w, w.n1b, w.eps);
    auto qkv = w.qkv(y).view({r, n, 3, h, dh}).permute({2, 0, 3, 1, 4});   // [3,R,H,n,Dh]
    auto newkv = qkv.narrow(0, 1, 2);
    if (write_index.has_value()) kv.scatter_(3, *write_index, newkv);
    else kv.narrow(3, t, n).copy_(newkv);
    auto keys = kv.select(0, 0).narrow(2, 0, kv_len), vals = kv.select(0, 1).narrow(2, 0, kv_len);
    auto a = at::scaled_dot_product_attention(qkv.select(0, 0), keys, vals, self_mask);
    x = x + w.so(a.transpose(1, 2).reshape({r, n, d}));
    y = at::layer_norm(x, {d}, w.n2w, w.n2b, w.eps);
    auto qq = w.q(y).view({r / g, g * n, h, dh}).transpose(1, 2);         // [R/G,H,G*n,Dh]
    auto mk = mem_kv.select(0, i);
    a = at::scaled_dot_product_attention(qq, mk.select(0, 0), mk.select(0, 1), mem_mask);
    x = x + w.co(a.transpose(1, 2).reshape({r, n, d}));
    y = at::layer_norm(x, {d}, w.n3w, w.n3b, w.eps);
    x = x + w.f2(at::relu(w.f1(y)));
  }
  return x;
}

// Greedy steps for R rows in one call (small models spend more in per-step Python than in arithmetic):
// embed the fed tokens, run decode_layers, take head 1's argmax (norm_project_argmax), feed it back; stop
// after `max_steps` steps or after the step in which a row ends (EOS, or its `room` tokens are used up), so
// the caller drops finished rows exactly where its Python loop would. Every op is the one BPDModel.decode and
// DecodeWeights.head1_argmax run, in the same order, so the tokens are those of the one-step path.
// Cache modes as model/cache.py: `lengths` None -> uniform, the new token at slot t of every row; else
// per-row lengths [R] (int64, slots counted after the `t` prefix slots) -> scatter writes and a mask.
// Returns (tokens [R, steps] int64, decoder output of the last step [R, D] before the final norm).
std::tuple<torch::Tensor, torch::Tensor> greedy_steps(
    torch::Tensor tok, const torch::Tensor& embed, double embed_scale, const torch::Tensor& pe, int64_t max_positions,
    const std::vector<StepLayer>& layers, const torch::Tensor& self_kv, const torch::Tensor& mem_kv,
    c10::optional<torch::Tensor> mem_mask, int64_t g, int64_t t, c10::optional<torch::Tensor> lengths,
    const torch::Tensor& nw, const torch::Tensor& nb, double eps, const Lin& proj, int64_t eos, torch::Tensor room,
    int64_t max_steps) {
  const int64_t r = tok.size(0), d = embed.size(1);
  const int64_t cap = self_kv.size(4);
  TORCH_CHECK(room.numel() == r && room.scalar_type() == torch::kLong, "greedy_steps: room must be int64 [R]");
  auto rm = room.contiguous();
  const int64_t* roomp = rm.data_ptr<int64_t>();
  std::vector<int64_t> len;                                                // per-row mode: slots after the prefix
  if (lengths.has_value()) {
    auto l = lengths->to(torch::kLong).contiguous();
    len.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + r);
  }
  const int64_t h = layers.empty() ? 1 : layers[0].n_heads, dh = d / h;
  auto x_tok = tok.to(torch::kLong).reshape({r, 1}).contiguous();
  auto out = torch::empty({r, std::max<int64_t>(max_steps, 0)}, x_tok.options());
  int64_t* outp = out.data_ptr<int64_t>();
  torch::Tensor last;
  int64_t s = 0;
  while (s < max_steps) {
    auto e = at::embedding(embed, x_tok).mul(embed_scale);                 // [R,1,D]
    torch::Tensor x, hs;
    if (len.empty()) {
      TORCH_CHECK(t + 1 <= cap, "KV cache capacity ", cap, " exceeded");
      x = e.add(pe.narrow(0, std::min(t, max_positions - 1), 1));
      hs = decode_layers(x, layers, self_kv, mem_kv, c10::nullopt, mem_mask, c10::nullopt, t, t + 1, g);
      t += 1;
    } else {
      auto slots = torch::empty({r, 1}, x_tok.options());
      int64_t* sp = slots.data_ptr<int64_t>();
      int64_t kv_len = 0;
      for (int64_t i = 0; i < r; i++) { sp[i] = t + len[i]; kv_len = std::max(kv_len, sp[i] + 1); }
      TORCH_CHECK(kv_len <= cap, "KV cache capacity ", cap, " exceeded (needs ", kv_len, ")");
      auto mask = torch::empty({r, 1, 1, kv_len}, self_kv.options());
      float* mp = mask.data_ptr<float>();
      for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < kv_len; j++) mp[i * kv_len + j] = j <= sp[i] ? 0.0f : -INFINITY;
      x = e.add(pe.index_select(0, slots.clamp_max(max_positions - 1).view({r})).view({r, 1, d}));
      auto index = slots.view({1, r, 1, 1, 1}).expand({2, r, h, 1, dh});
      hs = decode_layers(x, layers, self_kv, mem_kv, mask, mem_mask, index, 0, kv_len, g);
      for (auto& v : len) v += 1;
    }
    last = hs.select(1, 0);                                                 // [R,D]
    auto nxt = norm_project_argmax(last, nw, nb, eps, proj).contiguous();  // [R]
    const int64_t* np_ = nxt.data_ptr<int64_t>();
    bool ended = false;
    for (int64_t i = 0; i < r; i++) {
      outp[i * max_steps + s] = np_[i];
      ended |= np_[i] == eos || roomp[i] <= s + 1;
    }
    s += 1;
    x_tok = nxt.view({r, 1});
    if (ended) break;
  }
  return {out.narrow(1, 0, s), last};
}

std::string isa() { return BPD_NATIVE_ISA; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a [N,K] float32 weight for linear()");
  m.def("linear", &linear, "y = x . W^T (+ b) with a packed W");
  m.def("isa", &isa);
  pybind11::class_<Lin>(m, "Lin")
      .def(pybind11::init<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t,
                          int64_t>())
      .def("__call__", &Lin::operator());
  m.def("norm_project_argmax", &norm_project_argmax);
  pybind11::class_<StepLayer>(m, "StepLayer")
      .def(pybind11::init<int64_t, double, torch::Tensor, torch::Tensor, Lin, Lin, torch::Tensor, torch::Tensor, Lin, Lin,
                          torch::Tensor, torch::Tensor, Lin, Lin>());
  m.def("decode_layers", &decode_layers);
  m.def("propose", &propose);
  m.def("greedy_steps", &greedy_steps);
}
