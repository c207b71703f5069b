// The screened argmax: an fp32 projection's argmax read through an int8 copy of its weights and a proven error
// bound, the few outputs that can win computed exactly as the fp32 kernel computes them.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "step.h"

// An argmax over an fp32 projection's outputs without computing every output in fp32. An int8 copy of the weights
// (the I8D kernels: int8 activations x int8 weights; each row and its residual, see screened_ids) gives every output n an approximation a_n with a proven bound
// |z_n - a_n| <= E_n on its distance from the fp32 kernel's own result z_n (int8 rounding of the activation and of
// the weights, the fp32 FMA chain's rounding, the roundings of a_n itself; see screened_ids). Only the outputs whose
// a_n + E_n reaches max_m (a_m - E_m) can be the argmax; those are computed exactly as the fp32 kernel computes them
// (the same FMA chain, in order, from zero; then the bias), and the first largest wins: the fp32 argmax, the same id
// and the same logit bits, for a quarter of the weight bytes read (two int8 rows) plus a few exact rows.
struct Screen {
  Lin q;                        // the int8-compute copy (mode I8D), no bias (screened_ids adds it once)
  torch::Tensor w1, w2, e2;     // per output: sum_k |w_nk|, ||w_n||_2 and ||w_n - s_n q_n||_2, float, rounded up
  torch::Tensor w;              // the fp32 weight [N, K], row-major: a candidate's exact output reads one row
};

void Lin::add_screen(const torch::Tensor& w) {
  TORCH_CHECK(mode == F32 && BPD_I8_DOT, "add_screen: screens fp32 projections, on builds with int8 kernels");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K && w.scalar_type() == torch::kFloat32,
              "add_screen: w must be the float32 [N, K] weight this projection packed");
  auto wc = w.contiguous();
  if (!torch::isfinite(wc).all().item<bool>()) return;   // non-finite weights: no bound holds, every logit in fp32
  auto pk = pack(wc, I8D);
  // the int8 weights exactly as pack() rounded them (same float ops), then the bounds in double, a slice of rows at
  // a time (a large vocabulary's projection in double would be twice its fp32 size)
  auto w1 = torch::empty({N}, wc.options()), w2 = torch::empty({N}, wc.options()), e2 = torch::empty({N}, wc.options());
  const double up = 1.0 + 1e-6;                // float rounding of the double sums (2^-24 relative) covered
  for (int64_t r0 = 0; r0 < N; r0 += 4096) {
    const int64_t r = std::min<int64_t>(4096, N - r0);
    auto ws = wc.narrow(0, r0, r), ss = pk[1].narrow(0, r0, r).unsqueeze(1);
    auto q = torch::round(ws / ss).clamp_(-127, 127).to(torch::kDouble);
    auto wd = ws.to(torch::kDouble);
    w1.narrow(0, r0, r).copy_(wd.abs().sum(1) * up);
    w2.narrow(0, r0, r).copy_(wd.square().sum(1).sqrt() * up);
    e2.narrow(0, r0, r).copy_((wd - q * ss.to(torch::kDouble)).square().sum(1).sqrt() * up);
  }
  screen = std::make_shared<const Screen>(Screen{Lin(huge_pages(pk[0]), pk[1], c10::nullopt, N, K, I8D), w1, w2, e2, wc});
}

// the fp32 projection's output n for one row x [K], as its kernel computes it (one FMA per k, in order, from zero;
// then the bias), from the row-major weight: one contiguous row per output (the packed layout puts consecutive k of
// one output a cache line apart). Four outputs at a time, four independent FMA chains.
static void exact_outputs(const Lin& p, const float* x, const int64_t* n, int64_t count, float* z) {
  const int64_t K = p.K;
  const float* w = p.screen->w.data_ptr<float>();
  const float* b = p.bias.has_value() ? p.bias->data_ptr<float>() : nullptr;
  int64_t c = 0;
  for (; c + 4 <= count; c += 4) {
    const float *w0 = w + n[c] * K, *w1 = w + n[c + 1] * K, *w2 = w + n[c + 2] * K, *w3 = w + n[c + 3] * K;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int64_t k = 0; k < K; k++) {
      a0 = std::fma(x[k], w0[k], a0); a1 = std::fma(x[k], w1[k], a1);
      a2 = std::fma(x[k], w2[k], a2); a3 = std::fma(x[k], w3[k], a3);
    }
    z[c] = a0; z[c + 1] = a1; z[c + 2] = a2; z[c + 3] = a3;
  }
  for (; c < count; c++) {
    const float* wr = w + n[c] * K;
    float a = 0.0f;
    for (int64_t k = 0; k < K; k++) a = std::fma(x[k], wr[k], a);
    z[c] = a;
  }
  if (b)
    for (c = 0; c < count; c++) z[c] += b[n[c]];
}

// rows screened, rows that took the full fp32 pass, candidates computed exactly (screen_stats(); atomics: rows run
// on several threads)
static std::atomic<int64_t> g_screen_rows{0}, g_screen_full{0}, g_screen_cand{0};
static bool g_screen_two = false;   // AVX2 builds: the two int8 passes instead of the int16 one (tests; set_screen_two)

// the I8D kernel's quantisation of one row (run_mode's steps: the same q and scale), as floats; returns amax
static inline float i8_quantise(const float* x, int64_t K, float* q, float* rs) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *rs = amax / 127.0f;
  for (int64_t k = 0; k < K; k++) q[k] = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[k] * inv)));
  return amax;
}

#if BPD_I8_AVX2
// the AVX2 pass: rows y [M][K] quantised to int16 through the I8D weights -> a [M][N]; per row in cst: amax, the
// activation error ||x - rs q||, rs ||q||, 1 (finite) or 0
static void screen_pass_i16(const float* y, int64_t M, const Screen& sc, int64_t K, float* a, float* cst) {
  Work& ws = work();
  const int64_t N = sc.q.N;
  const int64_t K4 = kgroups(K, 4);
  const float Q = (float)std::min<int64_t>(32767, (int64_t)2147483647 / (127 * 4 * K4));
  thread_local std::vector<uint32_t> xi;
  if ((int64_t)xi.size() < 2 * M * K4) xi.resize(2 * M * K4);
  std::memset(xi.data(), 0, 2 * M * K4 * sizeof(uint32_t));
  float* rsr = grow(ws.sq, M);
  for (int64_t m = 0; m < M; m++) {
    const float* x = y + m * K;
    int16_t* o = (int16_t*)(xi.data() + 2 * m * K4);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < K; k++) { finite &= std::isfinite(x[k]); amax = std::max(amax, std::fabs(x[k])); }
    rsr[m] = 0.0f;
    if (!finite) continue;
    const float inv = amax > 0.0f ? Q / amax : 0.0f, rs = amax / Q;
    double e2x = 0.0, q2 = 0.0;                          // ||x - rs q||^2, ||q||^2
    for (int64_t k = 0; k < K; k++) {
      const float q = std::min(Q, std::max(-Q, std::nearbyint(x[k] * inv)));
      o[k] = (int16_t)q;
      const double d = (double)x[k] - (double)rs * (double)q;
      e2x += d * d;
      q2 += (double)q * (double)q;
    }
    rsr[m] = rs;
    cst[4 * m] = amax;
    cst[4 * m + 1] = (float)(std::sqrt(e2x) * 1.0001);
    cst[4 * m + 2] = (float)((double)rs * std::sqrt(q2) * 1.0001);
    cst[4 * m + 3] = 1.0f;
  }
  run<I16DotKern>(xi.data(), sc.q.data.data_ptr<int8_t>(), sc.q.scale->data_ptr<float>(), nullptr, a, M, N, K4, rsr);
}
#endif

// the two int8 passes: rows y [M][K] and their residuals through the I8D weights -> a [2M][N]; cst as above
// (the error terms ||rho|| + ||delta|| and rs ||q|| + rr ||q2||)
static void screen_pass_two(const float* y, int64_t M, const Screen& sc, int64_t K, float* a, float* cst) {
  Work& ws = work();
  float* xr = grow(ws.sres, 2 * M * K);                 // rows 0..M-1: y; rows M..2M-1: their residuals
  float* qb = grow(ws.sq, K);
  for (int64_t m = 0; m < M; m++) {
    const float* x = y + m * K;
    float* r = xr + (M + m) * K;
    std::memcpy(xr + m * K, x, K * sizeof(float));
    bool finite = true;
    for (int64_t k = 0; k < K; k++) finite &= std::isfinite(x[k]);
    if (!finite) {
      std::memset(r, 0, K * sizeof(float));
      continue;
    }
    float rs, rr;
    const float amax = i8_quantise(x, K, qb, &rs);
    double q2 = 0.0, dl2 = 0.0;                          // ||q||^2, ||delta||^2
    for (int64_t k = 0; k < K; k++) {
      r[k] = x[k] - rs * qb[k];
      q2 += (double)qb[k] * (double)qb[k];
    }
    for (int64_t k = 0; k < K; k++) {
      const double dl = ((double)x[k] - (double)rs * (double)qb[k]) - (double)r[k];
      dl2 += dl * dl;
    }
    i8_quantise(r, K, qb, &rr);
    double p2 = 0.0, rh2 = 0.0;                          // ||q2||^2, ||rho||^2
    for (int64_t k = 0; k < K; k++) {
      const double rh = (double)r[k] - (double)rr * (double)qb[k];
      rh2 += rh * rh;
      p2 += (double)qb[k] * (double)qb[k];
    }
    cst[4 * m] = amax;
    cst[4 * m + 1] = (float)((std::sqrt(rh2) + std::sqrt(dl2)) * 1.0001);                      // per unit ||w_n||
    cst[4 * m + 2] = (float)(((double)rs * std::sqrt(q2) + (double)rr * std::sqrt(p2)) * 1.0001);  // per ||e_n||
    cst[4 * m + 3] = 1.0f;
  }
  lin_rows(sc.q, xr, a, 2 * M);
}

// argmax of proj(y) for M rows y [M][K] through proj's int8 screen (struct Screen): the fp32 argmax exactly.
// Two int8 passes over the same weights in one call (2M rows): the row x, quantised by the I8D kernel as rs q, and
// its residual r = fl(x - rs q), quantised by the kernel as rr q2. LLM hidden states have outlier features (max |x_k|
// near 20 rms): one pass's activation error ||x - rs q|| left hundreds of candidates per row, and half the rows
// above the N / 16 cut (a full fp32 pass); the residual pass shrinks that term about 100-fold for one more int8
// row. With D1_n = sum_k q_k q_nk, D2_n = sum_k q2_k q_nk (exact integers), a_n = (fl(D1_n rs s_n) +
// fl(D2_n rr s_n)) + b_n in fp32, e_n = w_n - s_n q_n, rho = r - rr q2 and delta = x - rs q - r (both in double,
// exactly enough), and the fp32 result z_n = fl(sum_k x_k w_nk) + b_n:
//   x w_n = rs s_n D1 + rs q e_n + rr s_n D2 + rr q2 e_n + (rho + delta) w_n
//   |rs q e_n + rr q2 e_n| <= (rs ||q|| + rr ||q2||) ||e_n||; |(rho + delta) w_n| <= (||rho|| + ||delta||) ||w_n||
//   |fl(sum x w) - sum x w| <= (K + 2) u amax sum|w_n| (+1%)                  (K FMAs, then the bias' addition)
//   the roundings of a_n (two passes' int -> float and two products, their sum, the bias): <= 8 u (|a1| + |a2| + |b|)
// E_n is their sum, widened by 0.1% for its own fp32 arithmetic. Rows with a non-finite input take the full path.
// AVX2 builds, whose int8 kernels multiply int16 (vpmaddwd), take one pass instead: x quantised to int16, |q| <= Q with
// Q = min(32767, (2^31 - 1) / (127 * 4 K4)) so that no int32 sum overflows (rs = amax / Q, q2 = 0 above): a grid
// finer than the two int8 passes' for the cost of one row.
static void screened_ids(const float* y, int64_t M, const Lin& proj, int64_t* out, std::vector<float>& buf) {
  const Screen& sc = *proj.screen;
  const int64_t N = proj.N, K = proj.K;
  Work& ws = work();
  std::vector<float>& cstv = ws.scst;                    // per row: amax, cx, cq, finite
  cstv.assign(4 * M, 0.0f);
  float* cst = cstv.data();
  const bool two = !BPD_I8_AVX2 || g_screen_two;
  float* a = grow(buf, (two ? 2 : 1) * M * N);
#if BPD_I8_AVX2
  if (!two) screen_pass_i16(y, M, sc, K, a, cst);
#endif
  if (two) screen_pass_two(y, M, sc, K, a, cst);
  const float* w1 = sc.w1.data_ptr<float>();
  const float* w2 = sc.w2.data_ptr<float>();
  const float* e2 = sc.e2.data_ptr<float>();
  const float* bias = proj.bias.has_value() ? proj.bias->data_ptr<float>() : nullptr;
  constexpr float u = 0x1p-24f;
  // rows on the threads torch is given (a row's work is its own): a k-row verification at batch 32 screens
  // many rows a step
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t)(1 << 14) / std::max<int64_t>(1, N)), [&](int64_t m0, int64_t m1) {
  Work& tw = work();
  float* hi = grow(tw.shi, N);
  for (int64_t m = m0; m < m1; m++) {
    const float* x = y + m * K;
    g_screen_rows++;
    if (cst[4 * m + 3] == 0.0f) {
      g_screen_full++;
      float* l = grow(tw.big, N);
      lin_rows(proj, x, l, 1);
      out[m] = argmax_row(l, N);
      continue;
    }
    const float* a1 = a + m * N;
    const float* a2 = two ? a + (M + m) * N : nullptr;
    const float amax = cst[4 * m], cx = cst[4 * m + 1], cq = cst[4 * m + 2];
    const float cf = amax * (4.0f + 1.01f * (float)(K + 2)) * u;                    // per unit of sum |w_n|
    const vf vcx = vbcast(&cx), vcq = vbcast(&cq), vcf = vbcast(&cf);
    const float c8 = 8.0f * u, g = 1.001f, t = 1e-30f;
    const vf v8 = vbcast(&c8), vg = vbcast(&g), vt = vbcast(&t);
    const float ninf = -INFINITY;
    vf lov = vbcast(&ninf);
    int64_t n = 0;
    for (; n + L <= N; n += L) {
      const vf x1 = vload(a1 + n);
      vf s = x1, mag = vabs(x1);
      if (two) {
        const vf x2 = vload(a2 + n);
        s = vadd(x1, x2);
        mag = vadd(mag, vabs(x2));
      }
      if (bias) {
        const vf bv = vload(bias + n);
        s = vadd(s, bv);
        mag = vadd(mag, vabs(bv));
      }
      vf e = vfma(vload(w2 + n), vcx, vmul(vload(e2 + n), vcq));
      e = vfma(vload(w1 + n), vcf, e);
      e = vfma(vfma(mag, v8, e), vg, vt);
      lov = vmax(lov, vsub(s, e));
      vstore(hi + n, vadd(s, e));
    }
    float lo = hmax(lov);
    for (; n < N; n++) {
      const float b = bias ? bias[n] : 0.0f;
      const float s = (two ? a1[n] + a2[n] : a1[n]) + b;
      const float mag = std::fabs(a1[n]) + (two ? std::fabs(a2[n]) : 0.0f) + std::fabs(b);
      const float e = (w2[n] * cx + e2[n] * cq + w1[n] * cf + mag * c8) * g + t;
      lo = std::max(lo, s - e);
      hi[n] = s + e;
    }
    // the candidates, in order; more than N / 16 of them (flat logits: an untrained model, a random one) cost more
    // one row at a time than the fp32 pass over every output, which then gives the row's logits (the same bits)
    std::vector<int64_t>& cand = tw.scand;
    cand.clear();
    const vf vlo = vbcast(&lo);
    for (n = 0; n + L <= N; n += L)
      for (uint32_t bits = vge(vload(hi + n), vlo); bits; bits &= bits - 1) cand.push_back(n + __builtin_ctz(bits));
    for (; n < N; n++) if (hi[n] >= lo) cand.push_back(n);
    if (cand.empty() || (int64_t)cand.size() > std::max<int64_t>(8, N / 16)) {   // (empty: only if a bound is NaN)
      g_screen_full++;
      float* l = grow(tw.big, N);
      lin_rows(proj, x, l, 1);
      out[m] = argmax_row(l, N);
      continue;
    }
    g_screen_cand += (int64_t)cand.size();
    float* z = grow(tw.scz, cand.size());
    exact_outputs(proj, x, cand.data(), (int64_t)cand.size(), z);
    int64_t best = -1;                                   // the first largest exact output
    float bz = 0.0f;
    for (size_t c = 0; c < cand.size(); c++)
      if (best < 0 || z[c] > bz) { best = cand[c]; bz = z[c]; }
    out[m] = best;
  }
  });
}
