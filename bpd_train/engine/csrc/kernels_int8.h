// The int8-compute kernels: u8 activations times int8 weights, exact int32 sums (vpdpbusd on AVX512_VNNI, vpmaddwd
// on AVX2: the same integers).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "vec.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BPD_I8_DOT 1
// int8 compute: x is one row of 4 u8 per uint32 ([R][K4]), w one block: NB int32 initial accumulators, then
// [K4][NB][4] int8. Lane (i, n) sums exact integer products (no rounding), converted to float once at the end.
template <int R>
static inline void block_id(const uint32_t* x, int64_t K4, const int8_t* w, float* out /* [R][NB] */) {
  __m512i acc[R][NV];
  for (int j = 0; j < NV; j++) {
    const __m512i c = _mm512_loadu_si512((const void*)(w + j * 4 * L));
    for (int i = 0; i < R; i++) acc[i][j] = c;
  }
  const int8_t* wb = w + 4 * NB;
  for (int64_t p = 0; p < K4; p++) {
    const int8_t* wk = wb + p * 4 * NB;
    __m512i wv[NV];
    for (int j = 0; j < NV; j++) { __m512i t = _mm512_loadu_si512((const void*)(wk + j * 4 * L)); asm("" : "+v"(t)); wv[j] = t; }
    for (int i = 0; i < R; i++) {
      const __m512i xv = _mm512_set1_epi32((int)x[i * K4 + p]);
      for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NV; j++) _mm512_storeu_ps(out + i * NB + j * L, _mm512_cvtepi32_ps(acc[i][j]));
}
template <int R>
static inline void half_block_id(const uint32_t* x, int64_t K4, const int8_t* w, float* out, const int8_t* next) {
  constexpr int NH = NV / 2;
  const char* pf = (const char*)next;
  constexpr int64_t CH = NB * 4 / 2;   // prefetched bytes per iteration
  for (int hb = 0; hb < 2; hb++) {
    __m512i acc[R][NH];
    for (int j = 0; j < NH; j++) {
      const __m512i c = _mm512_loadu_si512((const void*)(w + (hb * NH + j) * 4 * L));
      for (int i = 0; i < R; i++) acc[i][j] = c;
    }
    const int8_t* wh = w + 4 * NB + hb * NH * 4 * L;
    for (int64_t p = 0; p < K4; p++) {
      const int8_t* wk = wh + p * 4 * NB;
      if (pf) {
        const char* q = pf + (hb * K4 + p) * CH;
        for (int64_t b = 0; b < CH; b += 64) _mm_prefetch(q + b, _MM_HINT_T1);
      }
      __m512i wv[NH];
      for (int j = 0; j < NH; j++) { __m512i t = _mm512_loadu_si512((const void*)(wk + j * 4 * L)); asm("" : "+v"(t)); wv[j] = t; }
      for (int i = 0; i < R; i++) {
        const __m512i xv = _mm512_set1_epi32((int)x[i * K4 + p]);
        for (int j = 0; j < NH; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < R; i++)
      for (int j = 0; j < NH; j++) _mm512_storeu_ps(out + i * NB + hb * NH * L + j * L, _mm512_cvtepi32_ps(acc[i][j]));
  }
}
#elif defined(__AVX2__)
#define BPD_I8_DOT 1
#define BPD_I8_AVX2 1
// int8 compute on AVX2 (no VNNI): the same u8 activations (q + 128) and the same int8 weights and initial
// accumulators, the weights' k-quads split into pairs ([K/4][2][64][2], pack()), multiplied as int16 with vpmaddwd
// (u8 and s8 widened: a pair's sum fits an int32 lane, no saturation, unlike vpmaddubsw's int16) and added in int32.
// Integer sums are exact in any order, so every output is the VNNI kernels' integer, converted to float once: int8
// compute gives the same bits on AVX2 and AVX-512 CPUs.
// rows x[0..RR) times outputs j0..j0+NO-1 of one block over quads p0..p1-1: from the initial accumulators (p0 = 0)
// or on from the int32 partial sums in acc32 [RR][NB] (integer sums: any split of k gives the same integers). x holds
// each row's u8 activations widened to int16, two per uint32 ([RR][2 K4]: run_mode's I8D step widens them once per
// call), so a row's k pair is one broadcast load.
template <int RR, int NO, bool S16 = false>
static inline void pass_id2(const uint32_t* x, int64_t K4, const int8_t* w, int j0, int32_t* acc32, int64_t p0,
                            int64_t p1) {
  constexpr int NA = NO / 8;
  const int32_t* head = (const int32_t*)w;               // -128 x column sums: the u8 offset's correction
  const int8_t* wb = w + 4 * NB;
  __m256i acc[RR][NA];
  for (int a = 0; a < RR; a++)
    for (int c = 0; c < NA; c++)
      acc[a][c] = p0 == 0 ? (S16 ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i*)(head + j0 + 8 * c)))
                          : _mm256_loadu_si256((const __m256i*)(acc32 + a * NB + j0 + 8 * c));
  for (int64_t p = p0; p < p1; p++) {
    for (int hp = 0; hp < 2; hp++) {                      // k pairs (0, 1) and (2, 3) of the quad
      const int8_t* wh = wb + p * 4 * NB + hp * 2 * NB + j0 * 2;
      if (RR == 1) {                                      // one row: each weight vector used once, loaded as needed
        const __m256i xv = _mm256_set1_epi32((int)x[2 * p + hp]);
        for (int c = 0; c < NA; c++) {
          const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wh + 16 * c)));  // 8 outputs x 2 k
          acc[0][c] = _mm256_add_epi32(acc[0][c], _mm256_madd_epi16(xv, wv));
        }
      } else {                                            // several rows: each weight vector widened once for all
        __m256i wv[NA];
        for (int c = 0; c < NA; c++) wv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wh + 16 * c)));
        for (int a = 0; a < RR; a++) {
          const __m256i xv = _mm256_set1_epi32((int)x[a * 2 * K4 + 2 * p + hp]);
          for (int c = 0; c < NA; c++) acc[a][c] = _mm256_add_epi32(acc[a][c], _mm256_madd_epi16(xv, wv[c]));
        }
      }
    }
  }
  for (int a = 0; a < RR; a++)
    for (int c = 0; c < NA; c++) _mm256_storeu_si256((__m256i*)(acc32 + a * NB + j0 + 8 * c), acc[a][c]);
}
// One row: all 64 outputs in one pass. Two or more rows: k in chunks of QC quads, every group of 4 rows (16 outputs
// at a time: 8 accumulators, each weight vector widened once for the 4), then a pair, then a last row, while the
// chunk's weights are in L1, so the block streams from memory once for all rows.
constexpr int64_t QC = 8;
template <int R, bool S16 = false>
static inline void block_id(const uint32_t* x, int64_t K4, const int8_t* w, float* out /* [R][NB] */) {
  alignas(32) int32_t acc32[R * NB];
  if (R == 1) {
    pass_id2<1, NB, S16>(x, K4, w, 0, acc32, 0, K4);
  } else {
    const int64_t xs = 2 * K4;                            // uint32 per row
    for (int64_t p0 = 0; p0 < K4; p0 += QC) {
      const int64_t p1 = std::min<int64_t>(K4, p0 + QC);
      int i = 0;
      for (; i + 4 <= R; i += 4)
        for (int j0 = 0; j0 < NB; j0 += 16) pass_id2<4, 16, S16>(x + i * xs, K4, w, j0, acc32 + i * NB, p0, p1);
      if (R - i >= 2) {
        for (int j0 = 0; j0 < NB; j0 += 32) pass_id2<2, 32, S16>(x + i * xs, K4, w, j0, acc32 + i * NB, p0, p1);
        i += 2;
      }
      if (R - i == 1) pass_id2<1, NB, S16>(x + i * xs, K4, w, 0, acc32 + i * NB, p0, p1);
    }
  }
  for (int i = 0; i < R; i++)
    for (int c = 0; c < NB; c += 8)
      _mm256_storeu_ps(out + i * NB + c, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(acc32 + i * NB + c))));
}
template <int R>
static inline void half_block_id(const uint32_t* x, int64_t K4, const int8_t* w, float* out, const int8_t*) {
  block_id<R>(x, K4, w, out);
}
// Signed int16 activations (two per uint32, [R][2 K4]) times the same packed int8 weights, from zero (no u8 offset):
// the screened argmax's finer activation grid on AVX2, where vpmaddwd reads int16 anyway (the caller keeps every
// int32 sum in range: |x| <= 2^31 / (127 * 4 K4))
template <int R>
static inline void block_i16(const uint32_t* x, int64_t K4, const int8_t* w, float* out) {
  block_id<R, true>(x, K4, w, out);
}
#else
#define BPD_I8_DOT 0
#endif
#ifndef BPD_I8_AVX2
#define BPD_I8_AVX2 0
#endif

}  // namespace
