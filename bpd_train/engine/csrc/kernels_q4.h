// The Q4F kernels: fp32 arithmetic over weights stored as 4-bit codes, for weights that are 4-bit blocks exactly
// (a GGUF's Q4_0 / Q4_1 / Q4_K tensors dequantised to fp32): w = fma(q, d, m), which is gguf's (d * q) + m because
// d (half precision, or Q4_K's float32 with at most 20 significant bits) times a 4-bit q is exact in float32 (the
// packer checks every weight against its fp32 value bit for bit), then one FMA per k into the row's accumulator in
// k order from zero: the fp32 kernels' chain, so the same bits, from under a fifth of the bytes. AVX2 instructions (AVX-512 builds run them too).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "vec.h"

namespace {

// Packed layout (engine/q4blocks.py pack_q4): per block of 64 weight rows, 4 sub-blocks of 16 rows, each
// [K/32] groups of Q4G bytes: d[16] and m[16] (float32, the group's scale and offset per row), then 32 k x 8 bytes
// of codes (byte j: row j's code in the low nibble, row j + 8's in the high one).
constexpr int64_t Q4G = 384;

static inline __m256i q4codes(const uint8_t* g, int64_t kk) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(g + 128 + 8 * kk)));
}

// R rows ([R][K]) times S sub-blocks side by side (16 weight rows each, ss bytes apart): out[i][s * 16 ..] at
// out + i * NB; pf (or null): the next block's same sub-blocks, fetched into L2 meanwhile (one row's four streams
// from memory are the prefetchers' hard case: docs/experiments.md 8.16). Each output's FMA chain runs over k in order from zero whatever R and
// S; S > 1 gives the FMA pipes 2 R S independent chains where one sub-block's 2 R would leave them waiting on their
// latency (a row or two).
// Every loop over rows and sub-blocks is unrolled: left as loops, the accumulators of 4 or more rows lived on the
// stack and were stored back every k (GCC 12), and a 4-row pass cost nearly two 2-row ones.
template <int R, int S>
static inline void q4_rows(const float* x, int64_t K, const uint8_t* w, int64_t ss, float* out, const char* pf) {
  __m256 acc[R][S][2];
#pragma GCC unroll 16
  for (int i = 0; i < R; i++)
#pragma GCC unroll 8
    for (int s = 0; s < S; s++) acc[i][s][0] = acc[i][s][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < K / 32; kb++) {
    const uint8_t* g[S];
    __m256 dv[S][2], mv[S][2];
#pragma GCC unroll 8
    for (int s = 0; s < S; s++) {
      g[s] = w + s * ss + kb * Q4G;
      if (pf) for (int b = 0; b < Q4G; b += 64) _mm_prefetch(pf + s * ss + kb * Q4G + b, _MM_HINT_T1);
      for (int h = 0; h < 2; h++) {
        dv[s][h] = _mm256_loadu_ps((const float*)g[s] + 8 * h);
        mv[s][h] = _mm256_loadu_ps((const float*)g[s] + 16 + 8 * h);
      }
    }
    for (int64_t kk = 0; kk < 32; kk++) {
      __m256 xb[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; i++) xb[i] = _mm256_broadcast_ss(x + i * K + kb * 32 + kk);
#pragma GCC unroll 8
      for (int s = 0; s < S; s++) {
        const __m256i c = q4codes(g[s], kk);
        const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15))), dv[s][0], mv[s][0]);
        const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), dv[s][1], mv[s][1]);
#pragma GCC unroll 16
        for (int i = 0; i < R; i++) {
          acc[i][s][0] = _mm256_fmadd_ps(xb[i], w0, acc[i][s][0]);
          acc[i][s][1] = _mm256_fmadd_ps(xb[i], w1, acc[i][s][1]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; i++)
#pragma GCC unroll 8
    for (int s = 0; s < S; s++) {
      _mm256_storeu_ps(out + i * NB + s * 16, acc[i][s][0]);
      _mm256_storeu_ps(out + i * NB + s * 16 + 8, acc[i][s][1]);
    }
}

// sub-blocks per pass: one row takes four side by side (two in AVX2's 16 registers); two or more rows take one at a
// time (side by side ran slower: their own chains already keep the FMA pipes busy)
template <int R>
constexpr int q4_side() {
#if defined(__AVX512F__)
  return R == 1 ? 4 : 1;
#else
  return R == 1 ? 2 : 1;
#endif
}
template <int R>
static inline void q4_block(const float* x, int64_t K, const uint8_t* w, float* out, const uint8_t* next) {
  constexpr int S = q4_side<R>();
  const int64_t ss = K / 32 * Q4G;   // bytes per sub-block
  for (int s0 = 0; s0 < 4; s0 += S)
    q4_rows<R, S>(x, K, w + s0 * ss, ss, out + s0 * 16, next ? (const char*)next + s0 * ss : nullptr);
}

struct Q4Kern {
  using X = float; using WT = uint8_t;
  static constexpr int xw = 1;
  static int64_t stride(int64_t K) { return 4 * (K / 32) * Q4G; }   // bytes per packed block of 64 rows
  template <int R> static void blk(const X* x, int64_t K, const WT* w, float* o, const WT* nx) {
    q4_block<R>(x, K, w, o, nx);
  }
  static void one(const X* x, int64_t K, const WT* w, float* o, const WT* nx) { q4_block<1>(x, K, w, o, nx); }
  template <int R> static void half(const X* x, int64_t K, const WT* w, float* o, const WT* nx) {
#if defined(__AVX512F__)
    q4_block<R>(x, K, w, o, nx);   // 5-8 rows in one pass: 16 accumulators, the codes decoded once for all
#else
    // 5-8 rows: 4, then the rest, per sub-block (its bytes are in L1 / L2 for the second pass)
    const int64_t ss = K / 32 * Q4G;
    for (int s = 0; s < 4; s++) {
      q4_rows<4, 1>(x, K, w + s * ss, ss, o + s * 16, nx ? (const char*)nx + s * ss : nullptr);
      q4_rows<R - 4, 1>(x + 4 * K, K, w + s * ss, ss, o + 4 * NB + s * 16, nullptr);
    }
#endif
  }
};

}  // namespace
