// The FMA kernels (fp32 activations; fp32, bf16 or int8 weights upconverted in registers): one packed block of 64
// weight rows times up to 8 activation rows, in the AVX-512 form and the AVX2 form.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "vec.h"

namespace {

#if defined(__AVX512F__)
constexpr int XW = 1;        // floats per activation in the buffer the kernels read
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
    for (int j = 0; j < NV; j++) { vf t = wload(wk + j * L); keep(t); wv[j] = t; }
    for (int i = 0; i < R; i++) {
      const vf xv = vbcast(x + i * K + k);
      for (int j = 0; j < NV; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NV; j++) vstore(out + i * NB + j * L, acc[i][j]);
}

// 5-8 rows: the same per-lane FMA chain, on one half of the block at a time (R x 2 accumulators), so every
// weight is read from memory once for up to 8 rows. With 4-row passes an 8-row block read each weight block
// twice, and the first pass waited on memory while the second waited on the FMA units.
template <int R, typename W>
static inline void half_block(const float* x, int64_t K, const W* w, float* out /* [R][NB] */, const W* next) {
  constexpr int NH = NV / 2;
  // the two half passes touch half of each weight row at a time, which the hardware prefetchers follow
  // poorly from memory: fetch the next block into L2 meanwhile (its bytes spread over the 2K iterations)
  const char* pf = (const char*)next;
  constexpr int64_t CH = NB * (int64_t)sizeof(W) / 2;   // prefetched bytes per iteration
  for (int hb = 0; hb < 2; hb++) {
    vf acc[R][NH];
    for (int i = 0; i < R; i++)
      for (int j = 0; j < NH; j++) acc[i][j] = vzero();
    const W* wh = w + hb * NH * L;
    for (int64_t k = 0; k < K; k++) {
      const W* wk = wh + k * NB;
      if (pf) {
        const char* p = pf + (hb * K + k) * CH;
        for (int64_t b = 0; b < CH; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
      }
      vf wv[NH];
      for (int j = 0; j < NH; j++) { vf t = wload(wk + j * L); keep(t); wv[j] = t; }
      for (int i = 0; i < R; i++) {
        const vf xv = vbcast(x + i * K + k);
        for (int j = 0; j < NH; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < R; i++)
      for (int j = 0; j < NH; j++) vstore(out + i * NB + hb * NH * L + j * L, acc[i][j]);
  }
}

#else  // AVX2
// 16 ymm registers cannot hold the AVX-512 form's R x 4 accumulators of 16 lanes (8 ymm per row, plus 8 for the kept
// weights): everything spilled, and a 4-row pass cost several 1-row passes. So AVX2 builds pack
// each block of 64 weight rows as 4 sub-blocks of 16 ([4][K][16], pack()), and the kernels run S sub-blocks at a
// time over their rows: R*S*2 accumulators + R activations + the weight vectors <= 16 registers, every weight
// stream read front to back (passes over the strided lanes of a [K][64] block ran at L3 latency: the demo's
// decoder linears got slower). Each row's activation is broadcast from memory per k (vbroadcastss ymm, m32: a load,
// no FMA-unit slot on Intel since Haswell and on AMD Zen), not from an [M][K][8] buffer of pre-broadcast rows,
// which outgrows L1 at 4-8 rows (docs/experiments.md, the CPU decoding engine). Output lane (i, n) is still
// x[i,k] * w[n,k] accumulated over k = 0..K-1 in order, one FMA each, from zero: bit-identical to the AVX-512 build
// and whatever the number of rows.
constexpr int XW = 1;        // floats per activation in the buffer the kernels read
constexpr int SB = 16;       // weight rows per sub-block
static inline __m256 w8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 w8(const uint16_t* p) { return bf8(p); }
static inline __m256 w8(const int8_t* p) { return i8x8(p); }

// R rows ([R][K]) times sub-blocks s0..s0+S-1 of one packed block, over k0..k1-1: from zero (k0 = 0) or on from
// the partial sums in out (stored floats reload exactly: the same FMA chain as one pass)
template <int R, int S, typename W>
static inline void subs(const float* x, int64_t K, const W* w, float* out, int s0, int64_t k0 = 0, int64_t k1 = -1) {
  if (k1 < 0) k1 = K;
  __m256 acc[R][S][2];
  for (int i = 0; i < R; i++)
    for (int s = 0; s < S; s++)
      for (int h = 0; h < 2; h++)
        acc[i][s][h] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + i * NB + (s0 + s) * SB + h * 8);
  const W* ws[S];
  for (int s = 0; s < S; s++) ws[s] = w + (int64_t)(s0 + s) * SB * K;
  for (int64_t k = k0; k < k1; k++) {
    __m256 xb[R];
    for (int i = 0; i < R; i++) xb[i] = _mm256_broadcast_ss(x + i * K + k);
    for (int s = 0; s < S; s++) {
      for (int h = 0; h < 2; h++) {
        const __m256 wv = w8(ws[s] + k * SB + h * 8);
        for (int i = 0; i < R; i++) acc[i][s][h] = _mm256_fmadd_ps(xb[i], wv, acc[i][s][h]);
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int s = 0; s < S; s++)
      for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + i * NB + (s0 + s) * SB + h * 8, acc[i][s][h]);
}

constexpr int64_t KC = 8;   // k per chunk of the multi-row passes
template <int R, typename W>
static inline void block(const float* xe, int64_t K, const W* w, float* out /* [R][NB] */) {
  static_assert(R >= 1 && R <= MB, "row groups of 1..4");
  constexpr int S = R == 1 ? 4 : R == 2 ? 2 : 1;
  if (S == 4) {
    for (int s0 = 0; s0 < NB / SB; s0 += S) subs<R, S>(xe, K, w, out, s0);
    return;
  }
  // fewer sub-blocks per pass than the block has: walk k in chunks, every sub-block's chunk in turn, so that the
  // block's weight streams are all read at once (as the one-row pass reads them), not one stream after another
  for (int64_t k0 = 0; k0 < K; k0 += KC)
    for (int s0 = 0; s0 < NB / SB; s0 += S) subs<R, S>(xe, K, w, out, s0, k0, std::min<int64_t>(K, k0 + KC));
}

// A lone row (M = 1: greedy, the proposals): all four sub-blocks in one pass
template <typename W>
static inline void block_one(const float* x, int64_t K, const W* w, float* out) {
  subs<1, 4, W>(x, K, w, out, 0);
}

// 5-8 rows: per k chunk and sub-block, 4 rows, then the rest (the chunk's bytes are in L1 by then)
template <int R, typename W>
static inline void half_block(const float* xe, int64_t K, const W* w, float* out /* [R][NB] */, const W*) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min<int64_t>(K, k0 + KC);
    for (int s0 = 0; s0 < NB / SB; s0++) {
      subs<4, 1>(xe, K, w, out, s0, k0, k1);
      subs<R - 4, 1>(xe + 4 * K * XW, K, w, out + 4 * NB, s0, k0, k1);
    }
  }
}
#endif

}  // namespace
