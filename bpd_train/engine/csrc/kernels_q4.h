// The Q4F kernels: fp32 arithmetic over weights stored as 4-bit codes, for weights that are 4-bit blocks exactly
// (a GGUF's Q4_0 / Q4_1 tensors dequantised to fp32): w = fma(q, d, m), which is gguf's (d * q) + m because a
// half-precision d times a 4-bit q is exact in float32 (the packer checks every weight against its fp32 value bit
// for bit), then one FMA per k into the row's accumulator in k order from zero: the fp32 kernels' chain, so the
// same bits, from under a fifth of the bytes. AVX2 instructions (AVX-512 builds run them too).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "vec.h"

namespace {

// Packed layout (engine/fastlinear.py pack_q4): per block of 64 weight rows, 4 sub-blocks of 16 rows, each
// [K/32] groups of Q4G bytes: d[16] and m[16] (float32, the group's scale and offset per row), then 32 k x 8 bytes
// of codes (byte j: row j's code in the low nibble, row j + 8's in the high one).
constexpr int64_t Q4G = 384;

static inline __m256 q4w(__m256i codes, const uint8_t* g, int h) {
  const __m256 q = _mm256_cvtepi32_ps(h ? _mm256_srli_epi32(codes, 4) : _mm256_and_si256(codes, _mm256_set1_epi32(15)));
  return _mm256_fmadd_ps(q, _mm256_loadu_ps((const float*)g + 8 * h), _mm256_loadu_ps((const float*)g + 16 + 8 * h));
}
static inline __m256i q4codes(const uint8_t* g, int64_t kk) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(g + 128 + 8 * kk)));
}

// R rows ([R][K]) times one sub-block (16 weight rows): out[i][0..16) at out + i * NB
template <int R>
static inline void q4_sub(const float* x, int64_t K, const uint8_t* w, float* out) {
  __m256 acc[R][2];
  for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < K / 32; kb++) {
    const uint8_t* g = w + kb * Q4G;
    for (int64_t kk = 0; kk < 32; kk++) {
      const __m256i c = q4codes(g, kk);
      const __m256 w0 = q4w(c, g, 0), w1 = q4w(c, g, 1);
      for (int i = 0; i < R; i++) {
        const __m256 xb = _mm256_broadcast_ss(x + i * K + kb * 32 + kk);
        acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
      }
    }
  }
  for (int i = 0; i < R; i++) {
    _mm256_storeu_ps(out + i * NB, acc[i][0]);
    _mm256_storeu_ps(out + i * NB + 8, acc[i][1]);
  }
}

// one row: two sub-blocks side by side (4 independent FMA chains; their scales and offsets stay in registers)
static inline void q4_one(const float* x, int64_t K, const uint8_t* w, float* out) {
  const int64_t ss = K / 32 * Q4G;   // bytes per sub-block
  for (int s0 = 0; s0 < 4; s0 += 2) {
    __m256 acc[2][2];
    for (int s = 0; s < 2; s++) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < K / 32; kb++) {
      const uint8_t* g[2] = {w + s0 * ss + kb * Q4G, w + (s0 + 1) * ss + kb * Q4G};
      __m256 dv[2][2], mv[2][2];
      for (int s = 0; s < 2; s++)
        for (int h = 0; h < 2; h++) {
          dv[s][h] = _mm256_loadu_ps((const float*)g[s] + 8 * h);
          mv[s][h] = _mm256_loadu_ps((const float*)g[s] + 16 + 8 * h);
        }
      for (int64_t kk = 0; kk < 32; kk++) {
        const __m256 xb = _mm256_broadcast_ss(x + kb * 32 + kk);
        for (int s = 0; s < 2; s++) {
          const __m256i c = q4codes(g[s], kk);
          const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
          const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
          acc[s][0] = _mm256_fmadd_ps(xb, _mm256_fmadd_ps(q0, dv[s][0], mv[s][0]), acc[s][0]);
          acc[s][1] = _mm256_fmadd_ps(xb, _mm256_fmadd_ps(q1, dv[s][1], mv[s][1]), acc[s][1]);
        }
      }
    }
    for (int s = 0; s < 2; s++) {
      _mm256_storeu_ps(out + (s0 + s) * 16, acc[s][0]);
      _mm256_storeu_ps(out + (s0 + s) * 16 + 8, acc[s][1]);
    }
  }
}

struct Q4Kern {
  using X = float; using WT = uint8_t;
  static constexpr int xw = 1;
  static int64_t stride(int64_t K) { return 4 * (K / 32) * Q4G; }   // bytes per packed block of 64 rows
  template <int R> static void blk(const X* x, int64_t K, const WT* w, float* o, const WT*) {
    const int64_t ss = K / 32 * Q4G;
    for (int s = 0; s < 4; s++) q4_sub<R>(x, K, w + s * ss, o + s * 16);
  }
  static void one(const X* x, int64_t K, const WT* w, float* o, const WT*) { q4_one(x, K, w, o); }
  // 5-8 rows: 4, then the rest, per sub-block (its bytes are in L1 / L2 for the second pass)
  template <int R> static void half(const X* x, int64_t K, const WT* w, float* o, const WT*) {
    const int64_t ss = K / 32 * Q4G;
    for (int s = 0; s < 4; s++) {
      q4_sub<4>(x, K, w + s * ss, o + s * 16);
      q4_sub<R - 4>(x + 4 * K, K, w + s * ss, o + 4 * NB + s * 16);
    }
  }
};

}  // namespace
