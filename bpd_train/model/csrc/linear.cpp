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
static_assert(MB == 4, "run() dispatches blocks of 1..4 rows");

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
        // 1-3 leftover rows in one pass too (a 3-row proposal pass read the weights three times)
        switch (std::min<int64_t>(M - m, MB)) {
          case 4: block<4>(x + m * K, K, wb, out); r = 4; break;
          case 3: block<3>(x + m * K, K, wb, out); r = 3; break;
          case 2: block<2>(x + m * K, K, wb, out); r = 2; break;
          default: block<1>(x + m * K, K, wb, out); r = 1;
        }
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
// the ~25 ATen ops per layer (dispatch, allocation, SDPA's setup) cost far more than their arithmetic (demo
// size: ~230 us of dispatch for ~0.7 M multiply-adds per token). Every row is computed by the same code
// whatever the batch or the number of tokens fed: layer norm, the packed linears and attention (one query at
// a time, slots in order), so a token's decoder output is bit-identical alone (greedy) or inside a block
// (blockwise verification) — which torch's SDPA did not guarantee (~1e-7 apart). Results differ from the
// torch path (model/layers.py) by rounding only.

static void lin_rows(const Lin& L, const float* x, float* y, int64_t M) {
  const float* bp = L.bias.has_value() ? L.bias->data_ptr<float>() : nullptr;
  const float* sp = L.scale.has_value() ? L.scale->data_ptr<float>() : nullptr;
  if (M <= 0) return;
  if (L.mode == F32) run(x, L.data.data_ptr<float>(), nullptr, bp, y, M, L.N, L.K);
  else if (L.mode == BF16) run(x, (const uint16_t*)L.data.data_ptr<int16_t>(), nullptr, bp, y, M, L.N, L.K);
  else run(x, L.data.data_ptr<int8_t>(), sp, bp, y, M, L.N, L.K);
}

// y = layer_norm(x) per row (two-pass mean / variance in order, as ATen's reference does it in exact math)
static void norm_rows(const float* x, float* y, int64_t M, int64_t D, const float* w, const float* b, float eps) {
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    double mean = 0.0;
    for (int64_t i = 0; i < D; i++) mean += xr[i];
    mean /= (double)D;
    double var = 0.0;
    for (int64_t i = 0; i < D; i++) { const double c = xr[i] - mean; var += c * c; }
    var /= (double)D;
    const float inv = (float)(1.0 / std::sqrt(var + (double)eps)), mu = (float)mean;
    for (int64_t i = 0; i < D; i++) yr[i] = (xr[i] - mu) * inv * w[i] + b[i];
  }
}

static inline float dot(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = vfma(vload(a + i), vload(b + i), acc);
  alignas(64) float lanes[L];
  vstore(lanes, acc);
  float s = 0.0f;
  for (int j = 0; j < L; j++) s += lanes[j];
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// out[0..dh) = softmax_j(q.k_j * scale + mask_j) v_j over slots j < len (keys/values `stride` floats apart)
static void attend(const float* q, const float* k, const float* v, int64_t stride, int64_t len, const float* mask,
                   float scale, float* out, int64_t dh, float* sc) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < len; j++) {
    float s = dot(q, k + j * stride, dh) * scale;
    if (mask) s += mask[j];
    sc[j] = s;
    mx = std::max(mx, s);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < len; j++) { sc[j] = std::exp(sc[j] - mx); sum += sc[j]; }
  const float inv = 1.0f / sum;
  int64_t i = 0;
  for (; i + L <= dh; i += L) {
    vf acc = vzero();
    for (int64_t j = 0; j < len; j++) {
      const float w = sc[j] * inv;
      acc = vfma(vbcast(&w), vload(v + j * stride + i), acc);
    }
    vstore(out + i, acc);
  }
  for (; i < dh; i++) {
    float acc = 0.0f;
    for (int64_t j = 0; j < len; j++) acc = std::fma(sc[j] * inv, v[j * stride + i], acc);
    out[i] = acc;
  }
}

// write_index: per-row slots [2,R,H,n,Dh] (its [0,r,0,j,0] is token j's slot in row r; per-row cache mode),
// else token j goes to slot t + j of every row (uniform mode). A query at slot p sees slots 0..p: the causal
// and per-row masks of model/cache.py, so self_mask is not read. mem_mask: additive [R/G,1,1,S] or None.
torch::Tensor decode_layers(torch::Tensor x_in, const std::vector<StepLayer>& layers, const torch::Tensor& self_kv,
                            const torch::Tensor& mem_kv, c10::optional<torch::Tensor> self_mask,
                            c10::optional<torch::Tensor> mem_mask, c10::optional<torch::Tensor> write_index, int64_t t,
                            int64_t kv_len, int64_t g) {
  (void)self_mask; (void)kv_len;
  TORCH_CHECK(self_kv.scalar_type() == torch::kFloat32 && mem_kv.scalar_type() == torch::kFloat32,
              "decode_layers: float32 caches only");
  const int64_t r = x_in.size(0), n = x_in.size(1), d = x_in.size(2), M = r * n;
  auto x_t = x_in.to(torch::kFloat32).contiguous().clone();
  float* x = x_t.data_ptr<float>();
  std::vector<int64_t> slot(M);
  if (write_index.has_value()) {
    auto si = write_index->select(0, 0).select(1, 0).select(2, 0).contiguous();   // [R,n]
    const int64_t* sp = si.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; m++) slot[m] = sp[m];
  } else {
    for (int64_t m = 0; m < M; m++) slot[m] = t + m % n;
  }
  int64_t max_slot = 0;
  for (auto v : slot) max_slot = std::max(max_slot, v);
  TORCH_CHECK(max_slot < self_kv.size(4), "decode_layers: KV cache capacity ", self_kv.size(4), " exceeded");
  const int64_t S = mem_kv.size(4);
  torch::Tensor mmask;
  const float* mm = nullptr;
  if (mem_mask.has_value()) {
    mmask = mem_mask->to(torch::kFloat32).contiguous();
    TORCH_CHECK(mmask.numel() == mem_kv.size(2) * S, "decode_layers: memory mask must be [R/G,1,1,S]");
    mm = mmask.data_ptr<float>();
  }
  const int64_t ks[6] = {self_kv.stride(0), self_kv.stride(1), self_kv.stride(2), self_kv.stride(3),
                         self_kv.stride(4), self_kv.stride(5)};
  const int64_t ms[6] = {mem_kv.stride(0), mem_kv.stride(1), mem_kv.stride(2), mem_kv.stride(3),
                         mem_kv.stride(4), mem_kv.stride(5)};
  TORCH_CHECK(ks[5] == 1 && ms[5] == 1, "decode_layers: caches must be contiguous in the head dimension");
  float* kv = self_kv.data_ptr<float>();
  const float* mk = mem_kv.data_ptr<float>();
  int64_t ff = 0;
  for (const auto& w : layers) ff = std::max(ff, w.f1.N);
  std::vector<float> y(M * d), big(M * std::max<int64_t>(3 * d, ff)), a(M * d), o(M * d);
  for (size_t li = 0; li < layers.size(); li++) {
    const StepLayer& w = layers[li];
    const int64_t h = w.n_heads, dh = d / h;
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    const float eps = (float)w.eps;
    // self-attention
    norm_rows(x, y.data(), M, d, w.n1w.data_ptr<float>(), w.n1b.data_ptr<float>(), eps);
    lin_rows(w.qkv, y.data(), big.data(), M);                                 // [M][3][H][Dh]
    float* kl = kv + li * ks[0];
    for (int64_t m = 0; m < M; m++) {
      const int64_t row = m / n;
      for (int64_t hh = 0; hh < h; hh++) {
        const float* src = big.data() + m * 3 * d + hh * dh;
        std::memcpy(kl + row * ks[2] + hh * ks[3] + slot[m] * ks[4], src + d, dh * sizeof(float));
        std::memcpy(kl + ks[1] + row * ks[2] + hh * ks[3] + slot[m] * ks[4], src + 2 * d, dh * sizeof(float));
      }
    }
    const int64_t kmax = max_slot + 1;
    at::parallel_for(0, M * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, kmax * dh)),
                     [&](int64_t lo, int64_t hi) {
      std::vector<float> sc(kmax);
      for (int64_t i = lo; i < hi; i++) {
        const int64_t m = i / h, hh = i % h, row = m / n;
        const float* base = kl + row * ks[2] + hh * ks[3];
        attend(big.data() + m * 3 * d + hh * dh, base, base + ks[1], ks[4], slot[m] + 1, nullptr, scale,
               a.data() + m * d + hh * dh, dh, sc.data());
      }
    });
    lin_rows(w.so, a.data(), o.data(), M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    // cross-attention: row `row` reads memory row row / g
    norm_rows(x, y.data(), M, d, w.n2w.data_ptr<float>(), w.n2b.data_ptr<float>(), eps);
    lin_rows(w.q, y.data(), o.data(), M);
    const float* ml = mk + li * ms[0];
    at::parallel_for(0, M * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, S * dh)),
                     [&](int64_t lo, int64_t hi) {
      std::vector<float> sc(S);
      for (int64_t i = lo; i < hi; i++) {
        const int64_t m = i / h, hh = i % h, b = (m / n) / g;
        const float* base = ml + b * ms[2] + hh * ms[3];
        attend(o.data() + m * d + hh * dh, base, base + ms[1], ms[4], S, mm ? mm + b * S : nullptr, scale,
               a.data() + m * d + hh * dh, dh, sc.data());
      }
    });
    lin_rows(w.co, a.data(), o.data(), M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    // feed-forward
    norm_rows(x, y.data(), M, d, w.n3w.data_ptr<float>(), w.n3b.data_ptr<float>(), eps);
    lin_rows(w.f1, y.data(), big.data(), M);
    for (int64_t i = 0; i < M * w.f1.N; i++) big[i] = std::max(big[i], 0.0f);
    lin_rows(w.f2, big.data(), o.data(), M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
  }
  return x_t;
}

// The proposal pass: heads lo..hi-1 at positions h [...,D] -> argmax ids [..., n_heads] (draft ids mapped back):
// state_i = h + fc2(relu(fc1(h)))[slice i]; logits = proj(layer_norm(state_i)). Raw buffers, no ATen ops
// (proposals only decide what is verified, so their rounding never reaches the output).
torch::Tensor propose(const torch::Tensor& h_in, const Lin& fc1, const Lin& fc2, int64_t n_heads,
                      const torch::Tensor& nw, const torch::Tensor& nb, double eps, const Lin& proj,
                      c10::optional<torch::Tensor> draft_ids) {
  const int64_t d = h_in.size(-1);
  auto h_t = h_in.to(torch::kFloat32).contiguous();
  const int64_t M = h_t.numel() / d, V = proj.N;
  const float* h = h_t.data_ptr<float>();
  std::vector<float> hid(M * fc1.N), st(M * n_heads * d), y(M * n_heads * d), logits(M * n_heads * V);
  lin_rows(fc1, h, hid.data(), M);
  for (auto& v : hid) v = std::max(v, 0.0f);
  lin_rows(fc2, hid.data(), st.data(), M);                                   // [M][n_heads][D]
  for (int64_t m = 0; m < M; m++)
    for (int64_t i = 0; i < n_heads * d; i++) st[m * n_heads * d + i] += h[m * d + i % d];
  norm_rows(st.data(), y.data(), M * n_heads, d, nw.data_ptr<float>(), nb.data_ptr<float>(), (float)eps);
  lin_rows(proj, y.data(), logits.data(), M * n_heads);
  auto shape = h_t.sizes().vec();
  shape.back() = n_heads;
  auto ids = torch::empty(shape, h_t.options().dtype(torch::kLong));
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* dp = nullptr;
  torch::Tensor dids;
  if (draft_ids.has_value()) { dids = draft_ids->to(torch::kLong).contiguous(); dp = dids.data_ptr<int64_t>(); }
  for (int64_t m = 0; m < M * n_heads; m++) {
    const float* l = logits.data() + m * V;
    int64_t best = 0;
    for (int64_t v = 1; v < V; v++) if (l[v] > l[best]) best = v;
    ip[m] = dp ? dp[best] : best;
  }
  return ids;
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
      x = e.add(pe.index_select(0, slots.clamp_max(max_positions - 1).view({r})).view({r, 1, d}));
      auto index = slots.view({1, r, 1, 1, 1}).expand({2, r, h, 1, dh});
      hs = decode_layers(x, layers, self_kv, mem_kv, c10::nullopt, mem_mask, index, 0, kv_len, g);
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

// Exact blockwise steps for ONE row in uniform cache mode (decoding/blockwise.py at batch 1, Exact rule), in
// one call: feed x (x0 + w-1 proposals) at slots t.., head 1's argmax at every position, accept the longest
// prefix of proposals head 1 agrees with (nothing after an EOS), then heads 1..w-1 propose at the accepted
// position. The same decode_layers / norm_project_argmax / propose as the one-step Python loop, so the same
// tokens. Stops after `max_steps` steps or the step in which the row ends (EOS, or `room` tokens used up).
// Returns (tokens gained, in order; per step: proposals accepted n and tokens gained c; next fed tokens [w];
// decoder output at the last accepted position [D]; 1 if the row ended).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t> block_steps(
    torch::Tensor x_in, const torch::Tensor& embed, double embed_scale, const torch::Tensor& pe, int64_t max_positions,
    const std::vector<StepLayer>& layers, const torch::Tensor& self_kv, const torch::Tensor& mem_kv,
    c10::optional<torch::Tensor> mem_mask, int64_t t, const torch::Tensor& nw, const torch::Tensor& nb, double eps,
    const Lin& proj, const Lin& fc1, const Lin& fc2, const Lin& draft_proj, c10::optional<torch::Tensor> draft_ids,
    int64_t eos, int64_t room, int64_t max_steps) {
  auto xt = x_in.to(torch::kLong).contiguous();
  const int64_t w = xt.numel();
  std::vector<int64_t> x(xt.data_ptr<int64_t>(), xt.data_ptr<int64_t>() + w), toks, nc;
  auto lopt = torch::TensorOptions().dtype(torch::kLong);
  torch::Tensor hn;
  int64_t ended = 0;
  for (int64_t s = 0; s < max_steps && !ended; s++) {
    auto tok = torch::from_blob(x.data(), {1, w}, lopt).clone();
    auto pos = (torch::arange(t, t + w, lopt)).clamp_max_(max_positions - 1);
    auto e = at::embedding(embed, tok).mul(embed_scale).add(pe.index_select(0, pos).unsqueeze(0));
    auto h = decode_layers(e, layers, self_kv, mem_kv, c10::nullopt, mem_mask, c10::nullopt, t, t + w, 1);
    auto gt = norm_project_argmax(h, nw, nb, eps, proj).contiguous();     // [1,w]
    const int64_t* g = gt.data_ptr<int64_t>();
    int64_t n = 0;
    while (n < w - 1 && x[n + 1] == g[n] && x[n] != eos) n++;
    const int64_t gn = g[n];
    const bool eos_in = x[n] == eos;
    const int64_t c = std::min<int64_t>(n + 1 - (eos_in ? 1 : 0), room);
    for (int64_t j = 0; j < c; j++) toks.push_back(j < n ? x[j + 1] : gn);
    nc.push_back(n);
    nc.push_back(c);
    room -= c;
    t += c;
    ended = (eos_in || gn == eos || room <= 0) ? 1 : 0;
    hn = h.select(0, 0).select(0, n);                                         // [D]
    x.assign(1, gn);
    if (!ended && w > 1) {
      auto p = propose(hn.unsqueeze(0), fc1, fc2, w - 1, nw, nb, eps, draft_proj, draft_ids).contiguous();
      const int64_t* pp = p.data_ptr<int64_t>();
      for (int64_t j = 0; j < w - 1; j++) x.push_back(pp[j]);
    }
  }
  x.resize(w, eos);
  auto cp = [&](const std::vector<int64_t>& v) {
    return torch::from_blob(const_cast<int64_t*>(v.data()), {(int64_t)v.size()}, lopt).clone();
  };
  return {cp(toks), cp(nc).view({-1, 2}), cp(x), hn, ended};
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
  m.def("block_steps", &block_steps);
}
