// Row-exact attention: each query's scores, softmax and value mix by one fixed instruction sequence, whatever the
// number of queries computed together.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "step.h"

// For each query a: out_a[0..dh) = softmax_j(q_a.k_j * scale + mask_j) v_j over slots j < len_a (keys/values
// `stride` elements apart, float or f16 (widened exactly as they load), shared by the nq queries: one cache row and
// head). Up to QB queries go through the slots
// together, so each value vector is loaded once for them and their FMA chains overlap, but every query's
// arithmetic is exactly that of the query alone, in the same order (scores; max; exp; sum; then per lane the FMA
// chain over its slots in order): a token's attention output is bit-identical whether it is decoded alone
// (greedy) or inside a block (blockwise verification), whatever nq. Head sizes 16/32/64/128 get unrolled code
// (NC = dh / 16 chunks held in registers); any other dh the same arithmetic with run-time loops.
// sc: scratch for QB * (max len rounded up to a multiple of 16, + 16) floats.
constexpr int QB = 4;

// 16 lanes folded to 8 (the first level of every slot's fixed sum tree)
static inline __m256 fold8(vf v) {
#if defined(__AVX512F__)
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  return _mm256_add_ps(v.lo, v.hi);
#endif
}

// lane i = the sum of f[i]'s 8 lanes, for 8 vectors at once: pairwise hadds, then the two 128-bit halves (a fixed
// tree per lane, whatever the other vectors hold)
static inline __m256 sum8x8(const __m256* f) {
  const __m256 t0 = _mm256_hadd_ps(f[0], f[1]), t1 = _mm256_hadd_ps(f[2], f[3]);
  const __m256 t2 = _mm256_hadd_ps(f[4], f[5]), t3 = _mm256_hadd_ps(f[6], f[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One query's scores over slots [0, len): sc[j] = (q.k_j) * scale (+ mask[j]). Each slot's dot product by one
// fixed order whatever len or its neighbours: per lane the FMA chain over the 16-float chunks of the head, the
// lanes folded 16 -> 8 -> 1 eight slots at a time (sum8x8), then the scalar remainder of dh % 16. Writes sc up to
// len rounded up to 8.
template <int NC, typename T>
static void scores(const float* q, const T* k, int64_t stride, int64_t len, int64_t dh, float scale,
                   const float* mask, float* sc) {
  const int nc = NC ? NC : (int)(dh / L);
  const int64_t rem = dh - (int64_t)nc * L;
  vf qv[NC ? NC : 1];
  if (NC) for (int c = 0; c < nc; c++) qv[c] = vload(q + c * L);
  const __m256 s8 = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    const int cnt = (int)std::min<int64_t>(8, len - j0);
    __m256 f[8];
    for (int i = 0; i < 8; i++) {
      if (i >= cnt || nc == 0) { f[i] = _mm256_setzero_ps(); continue; }
      const T* kj = k + (j0 + i) * stride;
      vf t = vmul(NC ? qv[0] : vload(q), vload(kj));
      for (int c = 1; c < nc; c++) t = vfma(NC ? qv[c] : vload(q + c * L), vload(kj + c * L), t);
      f[i] = fold8(t);
    }
    __m256 s = sum8x8(f);
    if (rem == 0) {
      _mm256_storeu_ps(sc + j0, _mm256_mul_ps(s, s8));
    } else {
      _mm256_storeu_ps(sc + j0, s);
      for (int i = 0; i < cnt; i++) {
        const T* kj = k + (j0 + i) * stride;
        float v = sc[j0 + i];
        for (int64_t e = (int64_t)nc * L; e < dh; e++) v = std::fma(q[e], sload(kj + e), v);
        sc[j0 + i] = v * scale;
      }
    }
  }
  if (mask) for (int64_t j = 0; j < len; j++) sc[j] += mask[j];
}

// out_b[c*16 ..] for NB queries whose weights p_b (softmax, normalised) cover slots [0, len_b), lmin = min len_b:
// per lane the FMA chain over the query's slots in order; the NB x NC accumulators stay in registers
template <int NB, int NC, typename T>
static inline void mix_fixed(const float* const* p, const int64_t* len, int64_t lmin, int64_t lmax, const T* v,
                             int64_t stride, float* const* out) {
  vf acc[NB][NC];
  for (int b = 0; b < NB; b++)
    for (int c = 0; c < NC; c++) acc[b][c] = vzero();
  int64_t j = 0;
  for (; j < lmin; j++) {                                  // every query of the group: one load of v_j
    const T* vj = v + j * stride;
    vf vv[NC];
    for (int c = 0; c < NC; c++) vv[c] = vload(vj + c * L);
    for (int b = 0; b < NB; b++) {
      const vf w = vbcast(p[b] + j);
      for (int c = 0; c < NC; c++) acc[b][c] = vfma(w, vv[c], acc[b][c]);
    }
  }
  for (; j < lmax; j++) {                                  // the longer queries' last slots
    const T* vj = v + j * stride;
    for (int b = 0; b < NB; b++) {
      if (j >= len[b]) continue;
      const vf w = vbcast(p[b] + j);
      for (int c = 0; c < NC; c++) acc[b][c] = vfma(w, vload(vj + c * L), acc[b][c]);
    }
  }
  for (int b = 0; b < NB; b++)
    for (int c = 0; c < NC; c++) vstore(out[b] + c * L, acc[b][c]);
}

// the same arithmetic for any dh: chunks outer, then the scalar remainder
template <typename T>
static void mix_any(int nb, const float* const* p, const int64_t* len, int64_t lmin, int64_t lmax, const T* v,
                    int64_t stride, float* const* out, int64_t dh) {
  int64_t i = 0;
  for (; i + L <= dh; i += L) {
    vf acc[QB];
    for (int b = 0; b < nb; b++) acc[b] = vzero();
    int64_t j = 0;
    for (; j < lmin; j++) {
      const vf vj = vload(v + j * stride + i);
      for (int b = 0; b < nb; b++) acc[b] = vfma(vbcast(p[b] + j), vj, acc[b]);
    }
    for (; j < lmax; j++) {
      const vf vj = vload(v + j * stride + i);
      for (int b = 0; b < nb; b++) {
        if (j >= len[b]) continue;
        acc[b] = vfma(vbcast(p[b] + j), vj, acc[b]);
      }
    }
    for (int b = 0; b < nb; b++) vstore(out[b] + i, acc[b]);
  }
  for (; i < dh; i++) {
    for (int b = 0; b < nb; b++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < len[b]; j++) acc = std::fma(p[b][j], sload(v + j * stride + i), acc);
      out[b][i] = acc;
    }
  }
}

// accumulators in registers: 16 vectors with AVX-512 (32 registers), 4 with AVX2 (each vf is two of 16)
#if defined(__AVX512F__)
constexpr int MIX_ACC = 16;
#else
constexpr int MIX_ACC = 4;
#endif

template <int NC, typename T>
static void mix(int nb, const float* const* p, const int64_t* len, int64_t lmin, int64_t lmax, const T* v,
                int64_t stride, float* const* out, int64_t dh) {
  if (NC == 0) return mix_any(nb, p, len, lmin, lmax, v, stride, out, dh);
  constexpr int G = NC ? std::max(1, MIX_ACC / std::max(1, NC)) : 1;   // queries per register-resident group
  for (int b0 = 0; b0 < nb; b0 += G) {
    const int g = std::min(G, nb - b0);
    int64_t lo = len[b0], hi = len[b0];
    for (int b = 1; b < g; b++) { lo = std::min(lo, len[b0 + b]); hi = std::max(hi, len[b0 + b]); }
    switch (g) {
      case 1: mix_fixed<1, NC ? NC : 1>(p + b0, len + b0, lo, hi, v, stride, out + b0); break;
      case 2: mix_fixed<std::min(2, G), NC ? NC : 1>(p + b0, len + b0, lo, hi, v, stride, out + b0); break;
      case 3: mix_fixed<std::min(3, G), NC ? NC : 1>(p + b0, len + b0, lo, hi, v, stride, out + b0); break;
      default: mix_fixed<std::min(4, G), NC ? NC : 1>(p + b0, len + b0, lo, hi, v, stride, out + b0); break;
    }
  }
}

// sc[0..len) -> softmax in place, by one fixed sequence (lanes of L slots from slot 0, padded to whole lanes with
// -inf): the scores' layout from slot 0 decides the rounding, so equal layouts give equal bits
static inline void softmax_row(float* sc, int64_t len) {
  const int64_t lp = (len + L - 1) / L * L;
  for (int64_t j = len; j < lp; j++) sc[j] = -INFINITY;
  vf mv = vload(sc);
  for (int64_t j = L; j < lp; j += L) mv = vmax(mv, vload(sc + j));
  const float mxs = hmax(mv);
  const vf mx = vbcast(&mxs);
  vf sv = vzero();
  for (int64_t j = 0; j < lp; j += L) {
    const vf e = vexp(vsub(vload(sc + j), mx));
    vstore(sc + j, e);
    sv = vadd(sv, e);
  }
  const float inv = 1.0f / hsum(sv);
  const vf iv = vbcast(&inv);
  for (int64_t j = 0; j < lp; j += L) vstore(sc + j, vmul(vload(sc + j), iv));
}

template <int NC, typename T>
static void attend_t(int64_t nq, const float* const* q, const int64_t* len, const T* k, const T* v,
                     int64_t stride, const float* mask, float scale, float* const* out, int64_t dh, float* sc) {
  static_assert(QB == 4, "mix() dispatches groups of 1..4 queries");
  for (int64_t a0 = 0; a0 < nq; a0 += QB) {
    const int nb = (int)std::min<int64_t>(QB, nq - a0);
    int64_t lmin = len[a0], lmax = len[a0];
    for (int b = 1; b < nb; b++) { lmin = std::min(lmin, len[a0 + b]); lmax = std::max(lmax, len[a0 + b]); }
    const int64_t sl = (lmax + L - 1) / L * L + L;      // scratch floats per query
    const float* p[QB];
    for (int b = 0; b < nb; b++) {
      float* scb = sc + b * sl;
      const int64_t ln = len[a0 + b];
      scores<NC>(q[a0 + b], k, stride, ln, dh, scale, mask, scb);
      softmax_row(scb, ln);
      p[b] = scb;
    }
    mix<NC>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh);
  }
}

template <typename T>
static void attend(int64_t nq, const float* const* q, const int64_t* len, const T* k, const T* v,
                   int64_t stride, const float* mask, float scale, float* const* out, int64_t dh, float* sc) {
  switch (dh) {
    case 16: return attend_t<1>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    case 32: return attend_t<2>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    case 64: return attend_t<4>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    case 128: return attend_t<8>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    default: return attend_t<0>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
  }
}

// nq queries, each over the slots j < len[a] with keep[a][j] set (a candidate tree's rows: the context and their own
// ancestors): a query's kept scores are packed side by side before the softmax, so they sit where a chain's would
// (the same lanes, the same bits as the query decoded alone after those tokens), then spread back with zero
// weights, which the value mix adds exactly; up to QB queries share each value load, as in attend_t.
// sc: scratch for QB * (max len rounded up to L, + 2 L) floats.
template <typename T>
static void attend_keep(int64_t nq, const float* const* q, const int64_t* len, const uint8_t* const* keep,
                        const T* k, const T* v, int64_t stride, float scale, float* const* out, int64_t dh,
                        float* sc) {
  thread_local std::vector<float> packed_buf;
  for (int64_t a0 = 0; a0 < nq; a0 += QB) {
    const int nb = (int)std::min<int64_t>(QB, nq - a0);
    int64_t lmin = len[a0], lmax = len[a0];
    for (int b = 1; b < nb; b++) { lmin = std::min(lmin, len[a0 + b]); lmax = std::max(lmax, len[a0 + b]); }
    const int64_t sl = (lmax + L - 1) / L * L + L;
    float* packed = grow(packed_buf, sl);
    const float* p[QB];
    for (int b = 0; b < nb; b++) {
      float* full = sc + b * sl;
      const int64_t ln = len[a0 + b];
      const uint8_t* kp = keep[a0 + b];
      switch (dh) {
        case 16: scores<1>(q[a0 + b], k, stride, ln, dh, scale, nullptr, full); break;
        case 32: scores<2>(q[a0 + b], k, stride, ln, dh, scale, nullptr, full); break;
        case 64: scores<4>(q[a0 + b], k, stride, ln, dh, scale, nullptr, full); break;
        case 128: scores<8>(q[a0 + b], k, stride, ln, dh, scale, nullptr, full); break;
        default: scores<0>(q[a0 + b], k, stride, ln, dh, scale, nullptr, full); break;
      }
      int64_t n = 0;
      for (int64_t j = 0; j < ln; j++)
        if (kp[j]) packed[n++] = full[j];
      softmax_row(packed, n);
      n = 0;
      for (int64_t j = 0; j < ln; j++) full[j] = kp[j] ? packed[n++] : 0.0f;
      p[b] = full;
    }
    switch (dh) {
      case 16: mix<1>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh); break;
      case 32: mix<2>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh); break;
      case 64: mix<4>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh); break;
      case 128: mix<8>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh); break;
      default: mix<0>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh); break;
    }
  }
}

// attend()'s per-thread buffers for tasks of up to nq queries over up to klen slots
struct AttnScratch {
  float* sc;
  const float** q;
  float** out;
  int64_t* len;
};
static AttnScratch attn_scratch(int64_t nq, int64_t klen) {
  thread_local std::vector<float> sc;
  thread_local std::vector<const float*> qp;
  thread_local std::vector<float*> op;
  thread_local std::vector<int64_t> ln;
  return {grow(sc, QB * (klen + 2 * L)), grow(qp, nq), grow(op, nq), grow(ln, nq)};
}
