// The bf16-compute kernels (AVX512_BF16, vdpbf16ps): bf16 activations times bf16 weights, fp32 accumulation.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "vec.h"

namespace {

#if defined(__AVX512BF16__)
#define BPD_BF16_DOT 1
// bf16 compute: x is one row of bf16 pairs per uint32 ([R][K2], K2 = ceil(K/2)), w one block of [K2][NB][2] bf16.
// Output lane (i, n) accumulates (x[i,2p] w[n,2p] + x[i,2p+1] w[n,2p+1]) over p = 0..K2-1 in order with one
// vdpbf16ps each: the same sequence for every row whatever R, as the fp32 kernels.
static inline __m512bh bhload(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512((const void*)p); }
static inline void keep(__m512bh& v) { asm("" : "+v"(v)); }
template <int R>
static inline void block_bd(const uint32_t* x, int64_t K2, const uint16_t* w, float* out /* [R][NB] */) {
  __m512 acc[R][NV];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; p++) {
    const uint16_t* wk = w + p * 2 * NB;
    __m512bh wv[NV];
    for (int j = 0; j < NV; j++) { __m512bh t = bhload(wk + j * 2 * L); keep(t); wv[j] = t; }
    for (int i = 0; i < R; i++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * K2 + p]);
      for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NV; j++) _mm512_storeu_ps(out + i * NB + j * L, acc[i][j]);
}
template <int R>
static inline void half_block_bd(const uint32_t* x, int64_t K2, const uint16_t* w, float* out, const uint16_t* next) {
  constexpr int NH = NV / 2;
  const char* pf = (const char*)next;
  constexpr int64_t CH = NB * 2 * (int64_t)sizeof(uint16_t) / 2;   // prefetched bytes per iteration
  for (int hb = 0; hb < 2; hb++) {
    __m512 acc[R][NH];
    for (int i = 0; i < R; i++)
      for (int j = 0; j < NH; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t* wh = w + hb * NH * 2 * L;
    for (int64_t p = 0; p < K2; p++) {
      const uint16_t* wk = wh + p * 2 * NB;
      if (pf) {
        const char* q = pf + (hb * K2 + p) * CH;
        for (int64_t b = 0; b < CH; b += 64) _mm_prefetch(q + b, _MM_HINT_T1);
      }
      __m512bh wv[NH];
      for (int j = 0; j < NH; j++) { __m512bh t = bhload(wk + j * 2 * L); keep(t); wv[j] = t; }
      for (int i = 0; i < R; i++) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * K2 + p]);
        for (int j = 0; j < NH; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < R; i++)
      for (int j = 0; j < NH; j++) _mm512_storeu_ps(out + i * NB + hb * NH * L + j * L, acc[i][j]);
  }
}
#else
#define BPD_BF16_DOT 0
#endif

}  // namespace
