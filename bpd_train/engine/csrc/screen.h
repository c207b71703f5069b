// The screened argmax: an fp32 projection's argmax read through an int8 copy of its weights and a proven error
// bound, the few outputs that can win computed exactly as the fp32 kernel computes them.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "step.h"

// An argmax over an fp32 projection's outputs without computing every output in fp32. An int8 copy of the weights
// (the I8D kernels: int8 activations x int8 weights) gives every output n an approximation a_n with a proven bound
// |z_n - a_n| <= E_n on its distance from the fp32 kernel's own result z_n (int8 rounding of the activation and of
// the weights, the fp32 FMA chain's rounding, the roundings of a_n itself; see screened_ids). Only the outputs whose
// a_n + E_n reaches max_m (a_m - E_m) can be the argmax; those are computed exactly as the fp32 kernel computes them
// (the same FMA chain, in order, from zero; then the bias), and the first largest wins: the fp32 argmax, the same id
// and the same logit bits, for a quarter of the weight bytes read plus a few exact rows.
struct Screen {
  Lin q;                        // the int8-compute copy (mode I8D), bias included
  torch::Tensor w1, ew;         // per output: sum_k |w_nk| and max_k |w_nk - s_n q_nk|, float, rounded up
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
  auto w1 = torch::empty({N}, wc.options()), ew = torch::empty({N}, wc.options());
  const double up = 1.0 + 1e-6;                // float rounding of the double sums (2^-24 relative) covered
  for (int64_t r0 = 0; r0 < N; r0 += 4096) {
    const int64_t r = std::min<int64_t>(4096, N - r0);
    auto ws = wc.narrow(0, r0, r), ss = pk[1].narrow(0, r0, r).unsqueeze(1);
    auto q = torch::round(ws / ss).clamp_(-127, 127).to(torch::kDouble);
    auto wd = ws.to(torch::kDouble);
    w1.narrow(0, r0, r).copy_(wd.abs().sum(1) * up);
    ew.narrow(0, r0, r).copy_((wd - q * ss.to(torch::kDouble)).abs().amax(1) * up);
  }
  screen = std::make_shared<const Screen>(Screen{Lin(pk[0], pk[1], bias, N, K, I8D), w1, ew});
}

// the fp32 projection's output n for one row x [K], as its kernel computes it (one FMA per k, in order, from zero;
// then the bias): the packed block of n's 64 outputs holds w_nk at [k][n % 64] (AVX-512), [n % 64 / 16][k][n % 16]
// (AVX2)
static inline float exact_output(const Lin& p, const float* x, int64_t n) {
  const int64_t K = p.K, j = n % NB;
  const float* w = p.data.data_ptr<float>() + (n / NB) * NB * K;
#if defined(__AVX512F__)
  const float* c = w + j;
  constexpr int64_t st = NB;
#else
  const float* c = w + (j / SB) * SB * K + j % SB;
  constexpr int64_t st = SB;
#endif
  float acc = 0.0f;
  for (int64_t k = 0; k < K; k++) acc = std::fma(x[k], c[k * st], acc);
  if (p.bias.has_value()) acc += p.bias->data_ptr<float>()[n];
  return acc;
}

// argmax of proj(y) for M rows y [M][K] through proj's int8 screen (struct Screen): the fp32 argmax exactly.
// Per row, with x the row, amax = max |x_k|, the I8D kernel's quantisation q_k = round(x_k * 127 / amax), rs = amax /
// 127, and D_n = sum_k q_k q_nk (exact integers), a_n = D_n rs s_n + b_n in fp32 and the fp32 result
// z_n = fl(sum_k x_k w_nk) + b_n:
//   |sum x w - rs s D| <= ex sum|w_n| + rs sum|q| max|w_n - s_n q_n|       (int8 rounding; ex = max_k |x_k - rs q_k|)
//   |fl(sum x w) - sum x w| <= (K + 2) u amax sum|w_n| (+1%)                  (K FMAs, then the bias' addition)
//   the roundings of a_n (int -> float, two products, the bias): <= 8 u (|a_n| + |b_n|)
// E_n is their sum, widened by 0.1% for its own fp32 arithmetic. Rows with a non-finite input take the full path.
static void screened_ids(const float* y, int64_t M, const Lin& proj, int64_t* out, std::vector<float>& buf) {
  const Screen& sc = *proj.screen;
  const int64_t N = proj.N, K = proj.K;
  float* a = grow(buf, M * N);
  lin_rows(sc.q, y, a, M);
  const float* w1 = sc.w1.data_ptr<float>();
  const float* ew = sc.ew.data_ptr<float>();
  const float* bias = proj.bias.has_value() ? proj.bias->data_ptr<float>() : nullptr;
  constexpr float u = 0x1p-24f;
  // rows on the threads torch is given (a row's work is its own): a k-row verification at batch 32 screens
  // many rows a step
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t)(1 << 14) / std::max<int64_t>(1, N)), [&](int64_t m0, int64_t m1) {
  Work& tw = work();
  float* hi = grow(tw.shi, N);
  for (int64_t m = m0; m < m1; m++) {
    const float* x = y + m * K;
    const float* am = a + m * N;
    // the row's quantisation, by run_mode's I8D steps (the same bytes)
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < K; k++) { finite &= std::isfinite(x[k]); amax = std::max(amax, std::fabs(x[k])); }
    if (!finite) {
      float* l = grow(tw.big, N);
      lin_rows(proj, x, l, 1);
      out[m] = argmax_row(l, N);
      continue;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, rs = amax / 127.0f;
    float ex = 0.0f;
    double q1 = 0.0;
    for (int64_t k = 0; k < K; k++) {
      const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[k] * inv)));
      q1 += std::fabs(q);
      ex = std::max(ex, std::fabs(x[k] - rs * q));
    }
    const float cx = ex * 1.0001f + amax * (4.0f + 1.01f * (float)(K + 2)) * u;   // per unit of sum |w_n|
    const float cq = (float)(rs * q1 * 1.0001);                                     // per unit of max |w_n - s q_n|
    const vf vcx = vbcast(&cx), vcq = vbcast(&cq);
    const float c8 = 8.0f * u, g = 1.001f, t = 1e-30f;
    const vf v8 = vbcast(&c8), vg = vbcast(&g), vt = vbcast(&t);
    const float ninf = -INFINITY;
    vf lov = vbcast(&ninf);
    int64_t n = 0;
    for (; n + L <= N; n += L) {
      const vf av = vload(am + n);
      vf mag = vabs(av);
      if (bias) mag = vadd(mag, vabs(vload(bias + n)));
      vf e = vfma(vload(w1 + n), vcx, vmul(vload(ew + n), vcq));
      e = vfma(vfma(mag, v8, e), vg, vt);
      lov = vmax(lov, vsub(av, e));
      vstore(hi + n, vadd(av, e));
    }
    float lo = hmax(lov);
    for (; n < N; n++) {
      const float mag = std::fabs(am[n]) + (bias ? std::fabs(bias[n]) : 0.0f);
      const float e = (w1[n] * cx + ew[n] * cq + mag * c8) * g + t;
      lo = std::max(lo, am[n] - e);
      hi[n] = am[n] + e;
    }
    // the candidates, in order; more than N / 64 of them (flat logits: an untrained model, a random one) cost more
    // one by one than the fp32 pass over every output, which then gives the row's logits instead (the same bits)
    std::vector<int64_t>& cand = tw.scand;
    cand.clear();
    const vf vlo = vbcast(&lo);
    for (n = 0; n + L <= N; n += L)
      for (uint32_t bits = vge(vload(hi + n), vlo); bits; bits &= bits - 1) cand.push_back(n + __builtin_ctz(bits));
    for (; n < N; n++) if (hi[n] >= lo) cand.push_back(n);
    if (cand.empty() || (int64_t)cand.size() > std::max<int64_t>(8, N / 64)) {   // (empty: only if a bound is NaN)
      float* l = grow(tw.big, N);
      lin_rows(proj, x, l, 1);
      out[m] = argmax_row(l, N);
      continue;
    }
    int64_t best = -1;                                   // the first largest exact output
    float bz = 0.0f;
    for (int64_t c : cand) {
      const float z = exact_output(proj, x, c);
      if (best < 0 || z > bz) { best = c; bz = z; }
    }
    out[m] = best;
  }
  });
}
