// Few-row linear layers for CPU decoding: y[M,N] = x[M,K] . W[N,K]^T (+ b), with W prepacked once.
//
// Why our own kernel: a decode step multiplies 1..k*rows activation rows by every weight matrix. On the
// CPUs we measured, BLAS/oneDNN fp32 GEMM with so few rows runs well below the memory bound and its cost
// grows with the number of rows, so a k-token blockwise call costs 2-4 one-token calls. Here W is packed
// into [N/64][K][64] blocks read in one linear stream (the hardware prefetcher's best case); each block is
// multiplied by up to 4 activation rows at once (16 vector accumulators, no horizontal sums), so k rows cost
// about what one row costs until the core runs out of FMA throughput. (AVX2 builds: [N/64][4][K][16], see the
// AVX2 kernels below: 16 ymm registers hold a quarter of what 32 zmm registers do.)
//
// Exactness: output (m, n) is always computed by the same instruction sequence (one FMA per k, in order),
// whatever M, the row blocking or the thread count.
// So a row gives bit-identical logits alone (greedy) or inside a k-row block (blockwise verification),
// and exact blockwise decoding is greedy decoding to the last bit, not just to the argmax.
//
// Weight formats: fp32; bf16 (upper half of the fp32 bits, upconverted exactly in registers); int8 with one
// fp32 scale per output row (weight-only quantisation: activations stay fp32). Compute formats where the CPU has
// them (BF16D, I8D below): bf16 x bf16 with vdpbf16ps, int8 x int8 with vpdpbusd, each activation row rounded /
// quantised on its own, so the row-exactness above holds for them too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <tuple>
#include <chrono>
#include <vector>
#include <memory>
#include <limits>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int L = 16;        // lanes per vector
constexpr int NV = 4;        // output vectors per block: NB = 64 outputs (weight rows) per block
constexpr int NB = NV * L;
constexpr int MB = 4;        // activation rows per register block (4 x 4 accumulators)
static_assert(MB == 4 && NV % 2 == 0, "run() dispatches blocks of 1..4 rows and half blocks of 5..8");

// BF16D: bf16 weights AND bf16 activations, dot products by vdpbf16ps (2 products per fp32 lane per
// instruction, fp32 accumulation) where the CPU has AVX512_BF16; weights packed as k-pairs ([N/64][K/2][64][2]).
// I8D: int8 weights (per output row scale) AND int8 activations (per activation row scale, stored as u8 = q + 128),
// dot products by vpdpbusd (4 products per int32 lane per instruction, exact integer accumulation) where the CPU
// has AVX512_VNNI, else by vpmaddwd on AVX2 (the same integers, so the same bits on every CPU); each packed block
// starts with -128 * (column sums) as the accumulators' initial value (the offset's correction), then [K/4][64][4]
// int8.
// BF16A: the BF16D format (inner dimension padded to whole AMX tiles) multiplied with AMX tiles (TDPBF16PS) for every
// row count, on CPUs with AMX; I8D runs on AMX tiles from AMX_MIN_ROWS rows on (the same bits, see the AMX kernels).
enum Mode { F32 = 0, BF16 = 1, I8 = 2, BF16D = 3, I8D = 4, BF16A = 5 };

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
// Pins a loaded weight vector in a register. Without it GCC folds the load into every FMA that uses it (a
// memory operand per FMA): a 4-row block then issued 16 vector loads per k instead of 4 and ran at ~60% of the
// FMA units' rate (demo-size projection, 4 rows: 49 -> ~39 us).
static inline void keep(vf& v) { asm("" : "+v"(v)); }  // (on a local: on an array element GCC stores it)
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
static inline void keep(vf& v) { asm("" : "+x"(v.lo), "+x"(v.hi)); }
#define BPD_NATIVE_ISA "avx2"
#else
#error "bpd_train native decode kernels need AVX2+FMA or AVX-512 (the Python side falls back to torch)"
#endif

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
// twice, and the first pass waited on memory while the second waited on the FMA units (Transformer-base at
// k = 8: the decoder and projection cost ~1.5x a 1-row pass instead of ~1.1x).
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
// weights): everything spilled, and on an AVX2-only EPYC a 4-row pass cost 2.7x a 1-row pass. So AVX2 builds pack
// each block of 64 weight rows as 4 sub-blocks of 16 ([4][K][16], pack()), and the kernels run S sub-blocks at a
// time over their rows: R*S*2 accumulators + R activations + the weight vectors <= 16 registers, every weight
// stream read front to back (passes over the strided lanes of a [K][64] block ran at L3 latency: the demo's
// decoder linears got slower). Each row's activation is broadcast from memory per k (vbroadcastss ymm, m32: a load,
// no FMA-unit slot on Intel since Haswell and on AMD Zen). Rows pre-broadcast into an [M][K][8] buffer instead were
// 1.4-2x slower at 4-8 rows on an AMD EPYC (Zen 4) running this build (the buffer outgrew L1 at K = 512: the demo's
// fc2 at 4 rows 14 us vs 7.3); an earlier measurement on an AVX2-only EPYC had favoured the buffer (4 rows of the
// demo's projection 226 -> 154 us) with the broadcast from a register. Output lane (i, n) is still x[i,k] * w[n,k]
// accumulated over k = 0..K-1 in order, one FMA each, from zero: bit-identical to the AVX-512 build and whatever the
// number of rows.
constexpr int XW = 1;        // floats per activation in the buffer the kernels read
constexpr int SB = 16;       // weight rows per sub-block
static inline __m256 w8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 w8(const uint16_t* p) { return bf8(p); }
static inline __m256 w8(const int8_t* p) { return i8x8(p); }

// R rows ([R][K]) times sub-blocks s0..s0+S-1 of one packed block
template <int R, int S, typename W>
static inline void subs(const float* x, int64_t K, const W* w, float* out, int s0) {
  __m256 acc[R][S][2];
  for (int i = 0; i < R; i++)
    for (int s = 0; s < S; s++) acc[i][s][0] = acc[i][s][1] = _mm256_setzero_ps();
  const W* ws[S];
  for (int s = 0; s < S; s++) ws[s] = w + (int64_t)(s0 + s) * SB * K;
  for (int64_t k = 0; k < K; k++) {
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

template <int R, typename W>
static inline void block(const float* xe, int64_t K, const W* w, float* out /* [R][NB] */) {
  static_assert(R >= 1 && R <= MB, "row groups of 1..4");
  constexpr int S = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int s0 = 0; s0 < NB / SB; s0 += S) subs<R, S>(xe, K, w, out, s0);
}

// A lone row (M = 1: greedy, the proposals): all four sub-blocks in one pass
template <typename W>
static inline void block_one(const float* x, int64_t K, const W* w, float* out) {
  subs<1, 4, W>(x, K, w, out, 0);
}

// 5-8 rows: 4 rows, then the rest (the block's bytes are in L1/L2 by then)
template <int R, typename W>
static inline void half_block(const float* xe, int64_t K, const W* w, float* out /* [R][NB] */, const W*) {
  block<4>(xe, K, w, out);
  block<R - 4>(xe + 4 * K * XW, K, w, out + 4 * NB);
}
#endif

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
// compute gives the same bits on AVX2 and AVX-512 CPUs. One row: all 64 outputs in one pass (8 accumulators, the
// weights read once, in order); two rows: 32 outputs per pass.
template <int RR, int NO>
static inline void pass_id2(const uint32_t* x, int64_t K4, const int8_t* w, int j0, float* out /* [RR][NB] */) {
  constexpr int NA = NO / 8;
  const int32_t* head = (const int32_t*)w;               // -128 x column sums: the u8 offset's correction
  const int8_t* wb = w + 4 * NB;
  __m256i acc[RR][NA];
  for (int a = 0; a < RR; a++)
    for (int c = 0; c < NA; c++) acc[a][c] = _mm256_loadu_si256((const __m256i*)(head + j0 + 8 * c));
  for (int64_t p = 0; p < K4; p++) {
    for (int hp = 0; hp < 2; hp++) {                      // k pairs (0, 1) and (2, 3) of the quad
      const int8_t* wh = wb + p * 4 * NB + hp * 2 * NB + j0 * 2;
      __m256i xv[RR];
      for (int a = 0; a < RR; a++) {
        const uint32_t u = x[a * K4 + p] >> (16 * hp);
        xv[a] = _mm256_set1_epi32((int)((u & 0xffu) | ((u & 0xff00u) << 8)));   // two u8 as two int16
      }
      for (int c = 0; c < NA; c++) {
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wh + 16 * c)));   // 8 outputs x 2 k
        for (int a = 0; a < RR; a++) acc[a][c] = _mm256_add_epi32(acc[a][c], _mm256_madd_epi16(xv[a], wv));
      }
    }
  }
  for (int a = 0; a < RR; a++)
    for (int c = 0; c < NA; c++) _mm256_storeu_ps(out + a * NB + j0 + 8 * c, _mm256_cvtepi32_ps(acc[a][c]));
}
template <int R>
static inline void block_id(const uint32_t* x, int64_t K4, const int8_t* w, float* out /* [R][NB] */) {
  for (int i = 0; i + 1 < R; i += 2)
    for (int j0 = 0; j0 < NB; j0 += 32) pass_id2<2, 32>(x + i * K4, K4, w, j0, out + i * NB);
  if (R & 1) pass_id2<1, NB>(x + (R - 1) * K4, K4, w, 0, out + (R - 1) * NB);
}
template <int R>
static inline void half_block_id(const uint32_t* x, int64_t K4, const int8_t* w, float* out, const int8_t*) {
  block_id<R>(x, K4, w, out);
}
#else
#define BPD_I8_DOT 0
#endif
#ifndef BPD_I8_AVX2
#define BPD_I8_AVX2 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && BPD_BF16_DOT && BPD_I8_DOT
#define BPD_AMX 1
// AMX tiles (Sapphire Rapids and later): one TDPBF16PS / TDPBUSD multiplies up to 16 activation rows by a 32 x 16
// (bf16) or 64 x 16 (int8) weight tile, so 16 rows cost about what one row costs. The packed formats are the
// vdpbf16ps / vpdpbusd ones ([K2][NB][2] bf16, [K4][NB][4] int8) with the inner dimension padded to whole tiles (16
// pairs / quads; zero weights, zero activations): a weight tile is 16 consecutive pairs (quads) of one 16-column
// chunk, i.e. rows 2*NB*2 (4*NB) bytes apart, loaded in place.
// Row-exactness: row m of a result tile depends on row m of the activation tile and the weights only, and every
// row's products are accumulated over the same tiles in the same order, whatever the number of rows in the tile.
// int8 sums are exact integers: the AMX and vpdpbusd kernels give the same bits, so they are mixed by row count.
// bf16: TDPBF16PS need not round like a chain of vdpbf16ps (amx_bf16_matches_vdpbf16ps() checks this CPU), so
// where they differ the AMX build runs AMX for every row count.
constexpr int64_t KT = 16;   // pairs (bf16) or quads (int8) per tile row

static bool amx_permitted() {
  // Linux hands the 8 KB tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileCfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: results (rows x 16 fp32 / int32), 4: activations (rows x 64 bytes), 5-7: weights (16 x 64 bytes).
// The configuration is checked, not remembered: oneDNN (torch's bf16 matmuls) configures tiles in the same threads.
static inline void amx_config(int rows) {
  TileCfg want{};
  want.palette = 1;
  for (int t = 0; t < 5; t++) { want.rows[t] = (uint8_t)rows; want.colsb[t] = 64; }
  for (int t = 5; t < 8; t++) { want.rows[t] = (uint8_t)KT; want.colsb[t] = 64; }
  TileCfg cur;
  _tile_storeconfig(&cur);
  if (std::memcmp(&cur, &want, sizeof(TileCfg)) != 0) _tile_loadconfig(&want);
}

// x [rows][Kp] (uint32: 2 bf16 / 4 u8 each), w one packed block; out [rows][NB] fp32
static inline void amx_bf16_block(const uint32_t* x, int64_t Kp, const uint16_t* w, float* out) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  constexpr int64_t ws = 2 * NB * 2;   // bytes between weight tile rows
  for (int64_t c = 0; c < Kp; c += KT) {
    _tile_loadd(4, x + c, Kp * 4);
    const uint16_t* wc = w + c * 2 * NB;
    _tile_loadd(5, wc, ws);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wc + 2 * L, ws);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wc + 4 * L, ws);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wc + 6 * L, ws);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, NB * 4);
  _tile_stored(1, out + L, NB * 4);
  _tile_stored(2, out + 2 * L, NB * 4);
  _tile_stored(3, out + 3 * L, NB * 4);
}

static inline void amx_i8_block(const uint32_t* x, int64_t Kp, const int8_t* w, float* out, int rows) {
  const int32_t* init = (const int32_t*)w;             // -128 * column sums: every row starts from them
  _tile_loadd(0, init, 0);
  _tile_loadd(1, init + L, 0);
  _tile_loadd(2, init + 2 * L, 0);
  _tile_loadd(3, init + 3 * L, 0);
  const int8_t* wb = w + 4 * NB;
  constexpr int64_t ws = 4 * NB;
  for (int64_t c = 0; c < Kp; c += KT) {
    _tile_loadd(4, x + c, Kp * 4);
    const int8_t* wc = wb + c * 4 * NB;
    _tile_loadd(5, wc, ws);
    _tile_dpbusd(0, 4, 5);
    _tile_loadd(6, wc + 4 * L, ws);
    _tile_dpbusd(1, 4, 6);
    _tile_loadd(7, wc + 8 * L, ws);
    _tile_dpbusd(2, 4, 7);
    _tile_loadd(5, wc + 12 * L, ws);
    _tile_dpbusd(3, 4, 5);
  }
  int32_t* acc = (int32_t*)out;                        // converted in place, as block_id converts its registers
  _tile_stored(0, acc, NB * 4);
  _tile_stored(1, acc + L, NB * 4);
  _tile_stored(2, acc + 2 * L, NB * 4);
  _tile_stored(3, acc + 3 * L, NB * 4);
  for (int i = 0; i < rows; i++)
    for (int j = 0; j < NB; j += L)
      _mm512_storeu_ps(out + i * NB + j, _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(acc + i * NB + j))));
}
#else
#define BPD_AMX 0
#endif

// The kernels run() drives, per weight format: Kr is the inner dimension as the kernels count it (K, or K/2
// pairs), which is also the activation row stride (in X) and the block stride / NB (in W elements, times Wk).
template <typename W> struct FmaKern {
  using X = float; using WT = W;
  static constexpr int xw = XW;                          // X elements per activation
  static int64_t stride(int64_t K) { return NB * K; }   // W elements per packed block
#if defined(__AVX512F__)
  template <int R> static void blk(const X* x, int64_t K, const W* w, float* o, const W*) { block<R>(x, K, w, o); }
  static void one(const X* x, int64_t K, const W* w, float* o, const W*) { block<1>(x, K, w, o); }
#else
  template <int R> static void blk(const X* x, int64_t K, const W* w, float* o, const W*) { block<R>(x, K, w, o); }
  static void one(const X* x, int64_t K, const W* w, float* o, const W*) { block_one(x, K, w, o); }
#endif
  template <int R> static void half(const X* x, int64_t K, const W* w, float* o, const W* nx) {
    half_block<R>(x, K, w, o, nx);
  }
};
#if BPD_BF16_DOT
struct Bf16DotKern {
  using X = uint32_t; using WT = uint16_t;
  static constexpr int xw = 1;
  static int64_t stride(int64_t K2) { return 2 * NB * K2; }
  template <int R> static void blk(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_bd<R>(x, K, w, o); }
  static void one(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_bd<1>(x, K, w, o); }
  template <int R> static void half(const X* x, int64_t K, const WT* w, float* o, const WT* nx) {
    half_block_bd<R>(x, K, w, o, nx);
  }
};
#endif
#if BPD_I8_DOT
struct I8DotKern {
  using X = uint32_t; using WT = int8_t;
  static constexpr int xw = 1;
  static int64_t stride(int64_t K4) { return 4 * NB * (K4 + 1); }   // the initial accumulators, then the weights
  template <int R> static void blk(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_id<R>(x, K, w, o); }
  static void one(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_id<1>(x, K, w, o); }
  template <int R> static void half(const X* x, int64_t K, const WT* w, float* o, const WT* nx) {
    half_block_id<R>(x, K, w, o, nx);
  }
};
#endif

// results of rows m..m+r-1 for outputs n0..n0+nn-1 from a kernel's out [r][NB]: the same rounding steps for every kernel
static inline void store_rows(const float* out, int r, float* y, int64_t m, int64_t N, int64_t n0, int nn,
                              const float* scale, const float* bias, const float* row_scale) {
  for (int i = 0; i < r; i++) {
    float* yr = y + (m + i) * N + n0;
    const float* o = out + i * NB;
    int j = 0;
#if defined(__AVX512F__)
    // 16 lanes at a time, each with the scalar loop's roundings in its order (mul, mul, add; no FMA contraction)
    const __m512 rsv = _mm512_set1_ps(row_scale ? row_scale[m + i] : 1.0f);
    for (; j + L <= nn; j += L) {
      __m512 s = _mm512_loadu_ps(o + j);
      if (row_scale) s = _mm512_mul_ps(s, rsv);
      if (scale) s = _mm512_mul_ps(s, _mm512_loadu_ps(scale + n0 + j));
      if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + n0 + j));
      _mm512_storeu_ps(yr + j, s);
    }
#endif
    for (; j < nn; j++) {
      float s = o[j];
      if (row_scale) s *= row_scale[m + i];
      if (scale) s *= scale[n0 + j];
      if (bias) s += bias[n0 + j];
      yr[j] = s;
    }
  }
}

template <typename Kern>
static void run(const typename Kern::X* x, const typename Kern::WT* w, const float* scale, const float* bias,
                float* y, int64_t M, int64_t N, int64_t K, const float* row_scale = nullptr) {
  using W = typename Kern::WT;
  const int64_t nblocks = (N + NB - 1) / NB;
  // split over output blocks only: every output is computed the same way whatever the thread count
  const int64_t work = std::max<int64_t>(1, K * NB * std::max<int64_t>(M, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t)(1 << 17) / work);
  at::parallel_for(0, nblocks, grain, [&](int64_t lo, int64_t hi) {
    alignas(64) float out[2 * MB * NB];
    for (int64_t nb = lo; nb < hi; nb++) {
      const W* wb = w + nb * Kern::stride(K);
      const W* next = nb + 1 < nblocks ? wb + Kern::stride(K) : nullptr;
      const int64_t n0 = nb * NB;
      const int nn = (int)std::min<int64_t>(NB, N - n0);
      for (int64_t m = 0; m < M;) {
        int r;
        const typename Kern::X* xm = x + m * K * Kern::xw;
        // 1-3 leftover rows in one pass too (a 3-row proposal pass read the weights three times)
        switch (std::min<int64_t>(M - m, 2 * MB)) {
          case 8: Kern::template half<8>(xm, K, wb, out, next); r = 8; break;
          case 7: Kern::template half<7>(xm, K, wb, out, next); r = 7; break;
          case 6: Kern::template half<6>(xm, K, wb, out, next); r = 6; break;
          case 5: Kern::template half<5>(xm, K, wb, out, next); r = 5; break;
          case 4: Kern::template blk<4>(xm, K, wb, out, next); r = 4; break;
          case 3: Kern::template blk<3>(xm, K, wb, out, next); r = 3; break;
          case 2: Kern::template blk<2>(xm, K, wb, out, next); r = 2; break;
          default:
            if (M == 1) Kern::one(xm, K, wb, out, next);
            else Kern::template blk<1>(xm, K, wb, out, next);
            r = 1;
        }
        store_rows(out, r, y, m, N, n0, nn, scale, bias, row_scale);
        m += r;
      }
    }
  });
}

// inner dimension of the BF16D / I8D formats in pairs / quads: whole AMX tiles in AMX builds
static inline int64_t kgroups(int64_t K, int64_t per) {
  const int64_t g = (K + per - 1) / per;
#if BPD_AMX
  return (g + KT - 1) / KT * KT;
#else
  return g;
#endif
}

#if BPD_AMX
constexpr int64_t AMX_MIN_ROWS = 4;   // int8: from this many rows on the tiles beat vpdpbusd (bench/engine.py --kernels)
static bool g_amx_off = false;        // BPD_AMX=0 (fastlinear.py): the AVX-512 kernels only

// x [Mp][Kp] with Mp = M rounded up to 16 where M > 16 (zero rows), w the packed blocks
template <bool I8>
static void run_amx(const uint32_t* x, const void* w, const float* scale, const float* bias, float* y, int64_t M,
                    int64_t N, int64_t Kp, const float* row_scale) {
  const int64_t nblocks = (N + NB - 1) / NB;
  const int64_t bstride = I8 ? 4 * NB * (Kp + 1) : 2 * NB * Kp;    // elements of w per packed block
  const int64_t work = std::max<int64_t>(1, Kp * NB * ((M + 15) / 16) * 4);
  const int64_t grain = std::max<int64_t>(1, (int64_t)(1 << 17) / work);
  const int rows_cfg = M < 16 ? (int)M : 16;
  at::parallel_for(0, nblocks, grain, [&](int64_t lo, int64_t hi) {
    alignas(64) float out[16 * NB];
    amx_config(rows_cfg);
    for (int64_t nb = lo; nb < hi; nb++) {
      const int64_t n0 = nb * NB;
      const int nn = (int)std::min<int64_t>(NB, N - n0);
      for (int64_t m = 0; m < M; m += 16) {
        const int r = (int)std::min<int64_t>(16, M - m);
        if (I8) amx_i8_block(x + m * Kp, Kp, (const int8_t*)w + nb * bstride, out, rows_cfg);
        else amx_bf16_block(x + m * Kp, Kp, (const uint16_t*)w + nb * bstride, out);
        store_rows(out, r, y, m, N, n0, nn, scale, bias, row_scale);
      }
    }
  });
}
#endif

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
  if (mode == I8 || mode == I8D) {
    scale = wp.abs().amax(1).div_(127.0f).clamp_min_(1e-30f);
    src = torch::round(wp / scale.unsqueeze(1)).clamp_(-127, 127);
  }
  if (mode == I8D) {  // [Np/NB] x (NB int32 = -128 * column sums, then [K4, NB, 4] int8), K padded to 4
    TORCH_CHECK(BPD_I8_DOT, "pack: this build has no int8-compute kernels (AVX512_VNNI or AVX2)");
    const int64_t K4 = kgroups(K, 4);
    auto q = torch::zeros({Np, 4 * K4}, w.options());
    q.narrow(1, 0, K).copy_(src);
    auto init = (q.sum(1) * -128.0f).to(torch::kInt32).view({Np / NB, NB}).view(torch::kInt8);   // [Np/NB, 4 NB]
#if BPD_I8_AVX2
    // AVX2: each quad as two k-pairs, [K4, 2, NB, 2] (vpmaddwd multiplies pairs)
    auto body = q.view({Np / NB, NB, K4, 2, 2}).permute({0, 2, 3, 1, 4}).reshape({Np / NB, K4 * NB * 4}).to(torch::kInt8);
#else
    auto body = q.view({Np / NB, NB, K4, 4}).permute({0, 2, 1, 3}).reshape({Np / NB, K4 * NB * 4}).to(torch::kInt8);
#endif
    return {torch::cat({init, body}, 1).contiguous(), scale.narrow(0, 0, N).contiguous()};
  }
  if (mode == BF16D || mode == BF16A) {  // k-pairs side by side, K padded to even (AMX builds: to tiles): [Np/NB, K2, NB, 2]
    TORCH_CHECK(BPD_BF16_DOT, "pack: this build has no AVX512_BF16 kernels");
    TORCH_CHECK(mode == BF16D || BPD_AMX, "pack: this build has no AMX kernels");
    const int64_t K2 = kgroups(K, 2);
    auto wq = torch::zeros({Np, 2 * K2}, w.options());
    wq.narrow(1, 0, K).copy_(wp);
    return {wq.view({Np / NB, NB, K2, 2}).permute({0, 2, 1, 3}).contiguous().to(torch::kBFloat16).view(torch::kInt16)};
  }
#if defined(__AVX512F__)
  auto blocked = src.view({Np / NB, NB, K}).transpose(1, 2).contiguous();  // [Np/NB, K, NB]
#else
  auto blocked = src.view({Np / NB, NB / SB, SB, K}).transpose(2, 3).contiguous();  // [Np/NB, NB/SB, K, SB] (AVX2)
#endif
  torch::Tensor out;
  if (mode == F32) out = blocked;
  else if (mode == BF16) out = blocked.to(torch::kBFloat16).view(torch::kInt16);
  else if (mode == I8) out = blocked.to(torch::kInt8);
  else TORCH_CHECK(false, "pack: unknown mode ", mode);
  if (mode == I8) return {out, scale.narrow(0, 0, N).contiguous()};
  return {out};
}

// x [M][K] float32 through a packed weight of any mode. BF16D rounds each activation row to bf16 first (round to
// nearest even, as torch's .to(bfloat16)): a row's rounding depends on that row alone.
static void run_mode(int64_t mode, const float* xp, const torch::Tensor& packed, const float* sp, const float* bp,
                     float* yp, int64_t M, int64_t N, int64_t K) {
  if (M <= 0) return;
  if (mode == F32) run<FmaKern<float>>(xp, packed.data_ptr<float>(), nullptr, bp, yp, M, N, K);
  else if (mode == BF16) run<FmaKern<uint16_t>>(xp, (const uint16_t*)packed.data_ptr<int16_t>(), nullptr, bp, yp, M, N, K);
  else if (mode == I8) run<FmaKern<int8_t>>(xp, packed.data_ptr<int8_t>(), sp, bp, yp, M, N, K);
#if BPD_BF16_DOT
  else if (mode == BF16D || mode == BF16A) {
    const int64_t K2 = kgroups(K, 2);
    const int64_t Mp = M > 16 ? (M + 15) / 16 * 16 : M;    // AMX reads whole 16-row tiles
    thread_local std::vector<uint32_t> xb;
    if ((int64_t)xb.size() < Mp * K2) xb.resize(Mp * K2);
    std::memset(xb.data(), 0, Mp * K2 * sizeof(uint32_t));
    auto bf = [](float f) -> uint32_t {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;   // NaN stays NaN
      return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    };
    for (int64_t m = 0; m < M; m++) {
      const float* xr = xp + m * K;
      uint32_t* o = xb.data() + m * K2;
      int64_t p = 0;
      // 16 pairs at a time, the scalar rounding's integer steps lane by lane (not vcvtne2ps2bf16, which flushes
      // subnormal inputs to zero): the same bits as bf() below
      const __m512i lo16 = _mm512_set1_epi32(0xffff), rb = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
      const __m512i absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
      const __m512i qnan = _mm512_set1_epi32(0x40);
      auto bf16v = [&](__m512i u) {
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, rb), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
        return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), qnan);
      };
      for (; p + L <= K / 2; p += L) {
        const __m512i a = _mm512_loadu_si512((const void*)(xr + 2 * p));            // pairs 0..7
        const __m512i b = _mm512_loadu_si512((const void*)(xr + 2 * p + L));        // pairs 8..15
        const __m512i ra = bf16v(a), rb2 = bf16v(b);
        // lane 2i holds the even element, 2i+1 the odd: (odd << 16) | even, per pair
        const __m512i ea = _mm512_or_si512(_mm512_and_si512(ra, lo16),
                                           _mm512_slli_epi64(_mm512_srli_epi64(ra, 32), 16));   // 64-bit lanes: pair
        const __m512i eb = _mm512_or_si512(_mm512_and_si512(rb2, lo16),
                                           _mm512_slli_epi64(_mm512_srli_epi64(rb2, 32), 16));
        // each 64-bit lane now holds one packed pair in its low 32 bits: gather the low halves
        const __m512i idx = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        _mm512_storeu_si512((void*)(o + p), _mm512_permutex2var_epi32(ea, idx, eb));
      }
      for (; p < K / 2; p++) o[p] = bf(xr[2 * p]) | (bf(xr[2 * p + 1]) << 16);
      if (K & 1) o[K / 2] = bf(xr[K - 1]);
    }
#if BPD_AMX
    if (mode == BF16A) {
      TORCH_CHECK(amx_permitted(), "linear: AMX tiles are not available to this process");
      run_amx<false>(xb.data(), packed.data_ptr<int16_t>(), nullptr, bp, yp, M, N, K2, nullptr);
      return;
    }
#endif
    TORCH_CHECK(mode == BF16D, "linear: this build has no AMX kernels");
    run<Bf16DotKern>(xb.data(), (const uint16_t*)packed.data_ptr<int16_t>(), nullptr, bp, yp, M, N, K2);
  }
#endif
#if BPD_I8_DOT
  else if (mode == I8D) {  // each activation row quantised on its own: x ~ sx * q, q = round(x / sx) in [-127, 127]
    const int64_t K4 = kgroups(K, 4);
    const int64_t Mp = M > 16 ? (M + 15) / 16 * 16 : M;
    thread_local std::vector<uint32_t> xq;
    thread_local std::vector<float> rs;
    if ((int64_t)xq.size() < Mp * K4) xq.resize(Mp * K4);
    if (Mp > M) std::memset(xq.data() + M * K4, 0x80, (Mp - M) * K4 * sizeof(uint32_t));   // q = 0
    if ((int64_t)rs.size() < M) rs.resize(M);
    for (int64_t m = 0; m < M; m++) {
      const float* xr = xp + m * K;
      // 16 lanes at a time with the scalar loop's steps (max is exact in any order; one multiply, round to nearest
      // even, clamp), so the same bytes: at demo size the scalar loop cost more than the int8 dot products
      int64_t k = 0;
      float amax = 0.0f;
#if defined(__AVX512F__)
      __m512 am = _mm512_setzero_ps();
      for (; k + L <= K; k += L) am = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xr + k)), am);
      amax = _mm512_reduce_max_ps(am);
#endif
      for (; k < K; k++) amax = std::max(amax, std::fabs(xr[k]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      rs[m] = amax / 127.0f;
      uint8_t* o = (uint8_t*)(xq.data() + m * K4);
      k = 0;
#if defined(__AVX512F__)
      const __m512 iv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
      const __m512i off = _mm512_set1_epi32(128);
      for (; k + L <= K; k += L) {
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + k), iv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);      // (max(q, -127) is -127 for NaN, as std::max(-127, q))
        _mm_storeu_si128((__m128i*)(o + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvttps_epi32(q), off)));
      }
#else
      const __m256 iv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
      for (; k + 8 <= K; k += 8) {
        __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), iv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);      // (max(q, -127) is -127 for NaN, as std::max(-127, q))
        alignas(32) int32_t qi[8];
        _mm256_store_si256((__m256i*)qi, _mm256_cvttps_epi32(q));
        for (int e = 0; e < 8; e++) o[k + e] = (uint8_t)(qi[e] + 128);
      }
#endif
      for (; k < 4 * K4; k++) {
        const float q = k < K ? std::nearbyint(xr[k] * inv) : 0.0f;
        o[k] = (uint8_t)((int)std::min(127.0f, std::max(-127.0f, q)) + 128);
      }
    }
#if BPD_AMX
    if (M >= AMX_MIN_ROWS && !g_amx_off && amx_permitted()) {
      run_amx<true>(xq.data(), packed.data_ptr<int8_t>(), sp, bp, yp, M, N, K4, rs.data());
      return;
    }
#endif
    run<I8DotKern>(xq.data(), packed.data_ptr<int8_t>(), sp, bp, yp, M, N, K4, rs.data());
  }
#endif
  else TORCH_CHECK(false, "linear: unknown or unsupported mode ", mode);
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
  run_mode(mode, xp, packed, sp, bp, yp, M, N, K);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// A packed linear layer as one object (what engine/fastlinear.py PackedLinear holds), so that the fused
// step functions below can chain several of them without returning to Python between ops.
struct Screen;
struct Lin {
  torch::Tensor data;
  c10::optional<torch::Tensor> scale, bias;
  int64_t N, K, mode;
  std::shared_ptr<const Screen> screen;   // fp32 output projections: int8 screening of the argmax (screened_ids)
  Lin(torch::Tensor d, c10::optional<torch::Tensor> s, c10::optional<torch::Tensor> b, int64_t n, int64_t k, int64_t md)
      : data(std::move(d)), scale(std::move(s)), bias(std::move(b)), N(n), K(k), mode(md) {}
  torch::Tensor operator()(const torch::Tensor& x) const { return linear(x, data, scale, bias, N, K, mode); }
  void add_screen(const torch::Tensor& w);
};

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

static void lin_rows(const Lin& L, const float* x, float* y, int64_t M) {
  const float* bp = L.bias.has_value() ? L.bias->data_ptr<float>() : nullptr;
  const float* sp = L.scale.has_value() ? L.scale->data_ptr<float>() : nullptr;
  run_mode(L.mode, x, L.data, sp, bp, y, M, L.N, L.K);
}

// ---- where a step's time goes (bench/engine.py --profile): per-phase seconds, off unless switched on ----
enum Phase { P_EMBED = 0, P_DEC_LIN, P_DEC_ATT, P_DEC_OTHER, P_VERIFY, P_HEADS_FFN, P_PROPOSE_PROJ, P_OTHER, P_N };
static bool g_prof = false;
static double g_prof_s[P_N] = {0};
static int64_t g_prof_steps = 0;
struct Tick {
  std::chrono::steady_clock::time_point t;
  Tick() { if (g_prof) t = std::chrono::steady_clock::now(); }
  void to(Phase p) {  // charge the time since the last tick to phase p
    if (!g_prof) return;
    auto now = std::chrono::steady_clock::now();
    g_prof_s[p] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

// Scratch buffers reused by every step (per thread): a decode step at demo size is ~100 us, and a dozen
// allocations per step were a measurable part of it.
struct Work {
  std::vector<float> y, big, a, o;           // decoder stack
  std::vector<float> x, logits, n1;          // loops: decoder input/output, head-1 logits, normed rows
  std::vector<float> shi;                    // screened argmax: each output's upper bound
  std::vector<int64_t> scand;                // screened argmax: the outputs that can win
  std::vector<float> hid, st, sy, plog;      // proposal pass
  std::vector<float> ce, cx;                 // chained proposals: embedded previous tokens, head inputs
  std::vector<int64_t> cprev;                // chained proposals: each row's previous token
  std::vector<int64_t> pids;                 // proposals: argmax ids before the draft map
  std::vector<int64_t> slot, pos, tok;
};
static Work& work() { thread_local Work w; return w; }
template <typename T> static T* grow(std::vector<T>& v, size_t n) { if (v.size() < n) v.resize(n); return v.data(); }

// sum of v[0..n) in double, 8 interleaved partial sums added in a fixed tree (one chain of n dependent adds was
// most of a layer norm's time; the order is the same for every row, whatever the batch)
static inline double sum8(const double* v, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += v[i + j];
  for (; i < n; i++) acc[i % 8] += v[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// y = layer_norm(x) per row (two-pass mean / variance in double, as ATen's reference does it in exact math)
static void norm_rows(const float* x, float* y, int64_t M, int64_t D, const float* w, const float* b, float eps) {
  thread_local std::vector<double> tmp;
  if ((int64_t)tmp.size() < D) tmp.resize(D);
  double* t = tmp.data();
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    for (int64_t i = 0; i < D; i++) t[i] = xr[i];
    const double mean = sum8(t, D) / (double)D;
    for (int64_t i = 0; i < D; i++) { const double c = t[i] - mean; t[i] = c * c; }
    const double var = sum8(t, D) / (double)D;
    const float inv = (float)(1.0 / std::sqrt(var + (double)eps)), mu = (float)mean;
    for (int64_t i = 0; i < D; i++) yr[i] = (xr[i] - mu) * inv * w[i] + b[i];
  }
}

// index of the first largest value (torch.argmax's choice on ties)
static inline int64_t argmax_row(const float* l, int64_t V) {
#if defined(__AVX512F__)
  if (V >= 4 * L) {
    // the largest value in one vector pass, then its first index: the scalar loop's answer (no NaN logits here),
    // in a fraction of its time (a k-row verification at batch 32 takes the argmax of 128 rows of V logits)
    __m512 mv = _mm512_loadu_ps(l);
    int64_t v = L;
    for (; v + L <= V; v += L) mv = _mm512_max_ps(mv, _mm512_loadu_ps(l + v));
    float bv = _mm512_reduce_max_ps(mv);
    for (; v < V; v++) bv = std::max(bv, l[v]);
    const __m512 b = _mm512_set1_ps(bv);
    int64_t i = 0;
    for (; i + L <= V; i += L) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + i), b, _CMP_EQ_OQ);
      if (eq) return i + __builtin_ctz((unsigned)eq);
    }
    for (; i < V; i++) if (l[i] == bv) return i;
  }
#endif
  int64_t best = 0;
  float bv = l[0];
  for (int64_t v = 1; v < V; v++) if (l[v] > bv) { bv = l[v]; best = v; }
  return best;
}

static void screened_ids(const float* y, int64_t M, const Lin& proj, int64_t* out, std::vector<float>& buf);

// argmax of proj(y) for M rows y [M][K], logits in buf: through proj's screen where it has one and the logits are
// not wanted (full: the caller reads all of them from buf afterwards, e.g. a top-n acceptance rule)
static void project_ids(const float* y, int64_t M, const Lin& proj, int64_t* out, bool full, std::vector<float>& buf) {
  if (proj.screen && !full) return screened_ids(y, M, proj, out, buf);
  float* l = grow(buf, M * proj.N);
  lin_rows(proj, y, l, M);
  for (int64_t m = 0; m < M; m++) out[m] = argmax_row(l + m * proj.N, proj.N);
}

// head 1's next token at M decoder outputs h [M][D]: argmax of proj(layer_norm(h)) (greedy, exact verification)
static void head1_ids(const float* h, int64_t M, int64_t D, const float* nw, const float* nb, float eps, const Lin& proj,
                      int64_t* out, bool full = false) {
  Work& ws = work();
  float* y = grow(ws.n1, M * D);
  norm_rows(h, y, M, D, nw, nb, eps);
  project_ids(y, M, proj, out, full, ws.logits);
}

torch::Tensor layer_norm(const torch::Tensor& h, const torch::Tensor& nw, const torch::Tensor& nb, double eps) {
  auto x = h.to(torch::kFloat32).contiguous();
  auto y = torch::empty_like(x);
  const int64_t d = x.size(-1);
  norm_rows(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() / d, d, nw.data_ptr<float>(), nb.data_ptr<float>(),
            (float)eps);
  return y;
}

// argmax over the vocabulary of proj(layer_norm(h)) for h [...,D] -> ids [...]
torch::Tensor norm_project_argmax(const torch::Tensor& h, const torch::Tensor& nw, const torch::Tensor& nb, double eps,
                                  const Lin& proj) {
  auto x = h.to(torch::kFloat32).contiguous();
  const int64_t d = x.size(-1);
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto ids = torch::empty(shape, x.options().dtype(torch::kLong));
  head1_ids(x.data_ptr<float>(), x.numel() / d, d, nw.data_ptr<float>(), nb.data_ptr<float>(), (float)eps, proj,
            ids.data_ptr<int64_t>());
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

// ---- the decoder stack for a decode step, without ATen ops ----
// model/layers.py decode_step (pre-norm, ReLU) for every layer in one call, on raw buffers: at decoding sizes
// the ~25 ATen ops per layer (dispatch, allocation, SDPA's setup) cost far more than their arithmetic (demo
// size: ~230 us of dispatch for ~0.7 M multiply-adds per token). Every row is computed by the same code
// whatever the batch or the number of tokens fed: layer norm, the packed linears and attention (each query's
// own arithmetic, slots in order), so a token's decoder output is bit-identical alone (greedy) or inside a block
// (blockwise verification) — which torch's SDPA did not guarantee (~1e-7 apart). Results differ from the
// torch path (model/layers.py) by rounding only.

static inline float hsum(vf v) {
  // a fixed tree (the same for every query): 16 lanes in 4 dependent adds, not 16
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
#endif
}

static inline float dot(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = hsum(acc);
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// exp of 16 lanes: 2^n e^r with n = round(x log2 e), r = x - n ln 2 (two-part ln 2), e^r by its degree-6 Taylor
// polynomial (|r| <= 0.35: ~1 ulp); lanes under -87.3 (e^x below FLT_MIN, masked slots at -inf) give 0.
// Vectorised, where std::exp per slot was ~1/3 of attention's time at demo size.
#if defined(__AVX512F__)
static inline vf vexp(vf x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
#else
static inline __m256 vexp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n for n in [-126, 128]: exponent bits; e^x with x near -87.3 can need n = -126 (still normal)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
static inline vf vexp(vf x) { return {vexp8(x.lo), vexp8(x.hi)}; }
static inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline float hmax(vf v) {
  __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
static inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
#endif

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

#if defined(__AVX512F__)
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
static inline uint32_t vge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
#else
static inline vf vabs(vf a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
static inline uint32_t vge(vf a, vf b) {
  return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ)) |
         ((uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ)) << 8);
}
#endif

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
  // rows on the threads torch is given (a row's work is its own): ~1 us a row at the demo's V = 4000, which at
  // batch 32 and k = 4 is 128 rows a step
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

// For each query a: out_a[0..dh) = softmax_j(q_a.k_j * scale + mask_j) v_j over slots j < len_a (keys/values
// `stride` floats apart, shared by the nq queries: one cache row and head). Up to QB queries go through the slots
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
template <int NC>
static void scores(const float* q, const float* k, int64_t stride, int64_t len, int64_t dh, float scale,
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
      const float* kj = k + (j0 + i) * stride;
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
        const float* kj = k + (j0 + i) * stride;
        float v = sc[j0 + i];
        for (int64_t e = (int64_t)nc * L; e < dh; e++) v = std::fma(q[e], kj[e], v);
        sc[j0 + i] = v * scale;
      }
    }
  }
  if (mask) for (int64_t j = 0; j < len; j++) sc[j] += mask[j];
}

// out_b[c*16 ..] for NB queries whose weights p_b (softmax, normalised) cover slots [0, len_b), lmin = min len_b:
// per lane the FMA chain over the query's slots in order; the NB x NC accumulators stay in registers
template <int NB, int NC>
static inline void mix_fixed(const float* const* p, const int64_t* len, int64_t lmin, int64_t lmax, const float* v,
                             int64_t stride, float* const* out) {
  vf acc[NB][NC];
  for (int b = 0; b < NB; b++)
    for (int c = 0; c < NC; c++) acc[b][c] = vzero();
  int64_t j = 0;
  for (; j < lmin; j++) {                                  // every query of the group: one load of v_j
    const float* vj = v + j * stride;
    vf vv[NC];
    for (int c = 0; c < NC; c++) vv[c] = vload(vj + c * L);
    for (int b = 0; b < NB; b++) {
      const vf w = vbcast(p[b] + j);
      for (int c = 0; c < NC; c++) acc[b][c] = vfma(w, vv[c], acc[b][c]);
    }
  }
  for (; j < lmax; j++) {                                  // the longer queries' last slots
    const float* vj = v + j * stride;
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
static void mix_any(int nb, const float* const* p, const int64_t* len, int64_t lmin, int64_t lmax, const float* v,
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
      for (int64_t j = 0; j < len[b]; j++) acc = std::fma(p[b][j], v[j * stride + i], acc);
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

template <int NC>
static void mix(int nb, const float* const* p, const int64_t* len, int64_t lmin, int64_t lmax, const float* v,
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

template <int NC>
static void attend_t(int64_t nq, const float* const* q, const int64_t* len, const float* k, const float* v,
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
      const int64_t lp = (ln + L - 1) / L * L;
      for (int64_t j = ln; j < lp; j++) scb[j] = -INFINITY;
      vf mv = vload(scb);
      for (int64_t j = L; j < lp; j += L) mv = vmax(mv, vload(scb + j));
      const float mxs = hmax(mv);
      const vf mx = vbcast(&mxs);
      vf sv = vzero();
      for (int64_t j = 0; j < lp; j += L) {
        const vf e = vexp(vsub(vload(scb + j), mx));
        vstore(scb + j, e);
        sv = vadd(sv, e);
      }
      const float inv = 1.0f / hsum(sv);
      const vf iv = vbcast(&inv);
      for (int64_t j = 0; j < lp; j += L) vstore(scb + j, vmul(vload(scb + j), iv));
      p[b] = scb;
    }
    mix<NC>(nb, p, len + a0, lmin, lmax, v, stride, out + a0, dh);
  }
}

static void attend(int64_t nq, const float* const* q, const int64_t* len, const float* k, const float* v,
                   int64_t stride, const float* mask, float scale, float* const* out, int64_t dh, float* sc) {
  switch (dh) {
    case 16: return attend_t<1>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    case 32: return attend_t<2>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    case 64: return attend_t<4>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    case 128: return attend_t<8>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
    default: return attend_t<0>(nq, q, len, k, v, stride, mask, scale, out, dh, sc);
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

// Cache row dst = cache row src of a [L,2,R,H,slots,Dh] cache (strides st, sizes n), its first `slots` slots
static void move_cache_row(float* base, const int64_t* st, const int64_t* n, int64_t dst, int64_t src, int64_t slots) {
  for (int64_t a = 0; a < n[0]; a++)
    for (int64_t b = 0; b < n[1]; b++)
      for (int64_t hh = 0; hh < n[3]; hh++) {
        float* to = base + a * st[0] + b * st[1] + dst * st[2] + hh * st[3];
        const float* from = base + a * st[0] + b * st[1] + src * st[2] + hh * st[3];
        if (st[4] == n[5]) std::memcpy(to, from, slots * n[5] * sizeof(float));
        else for (int64_t j = 0; j < slots; j++) std::memcpy(to + j * st[4], from + j * st[4], n[5] * sizeof(float));
      }
}

// The cache a decode step reads and writes (model/cache.py layout): self [L,2,R,H,cap,Dh], memory
// [L,2,R/G,H,S,Dh], additive memory mask [R/G,S] or none.
struct Cache {
  float* kv;
  float* mk;
  float* mm;
  int64_t ks[6], ms[6], kn[6], mn[6], cap, S, g;
  torch::Tensor mask_keep;
  Cache(const torch::Tensor& self_kv, const torch::Tensor& mem_kv, const c10::optional<torch::Tensor>& mem_mask,
        int64_t g_) : g(g_) {
    TORCH_CHECK(self_kv.scalar_type() == torch::kFloat32 && mem_kv.scalar_type() == torch::kFloat32,
                "decode: float32 caches only");
    for (int i = 0; i < 6; i++) {
      ks[i] = self_kv.stride(i);
      ms[i] = mem_kv.stride(i);
      kn[i] = self_kv.size(i);
      mn[i] = mem_kv.size(i);
    }
    TORCH_CHECK(ks[5] == 1 && ms[5] == 1, "decode: caches must be contiguous in the head dimension");
    kv = self_kv.data_ptr<float>();
    mk = mem_kv.data_ptr<float>();
    cap = self_kv.size(4);
    S = mem_kv.size(4);
    mm = nullptr;
    if (mem_mask.has_value()) {
      mask_keep = mem_mask->to(torch::kFloat32).contiguous();
      TORCH_CHECK(mask_keep.numel() == mem_kv.size(2) * S, "decode: memory mask must be [R/G,1,1,S]");
      mm = mask_keep.data_ptr<float>();
    }
  }
  // row dst of the caches = row src (self cache: its first `filled` slots), rows not sharing memory (g == 1)
  void move_row(int64_t dst, int64_t src, int64_t filled) const {
    TORCH_CHECK(g == 1, "move_row: rows share memory rows");
    move_cache_row(kv, ks, kn, dst, src, filled);
    move_cache_row(mk, ms, mn, dst, src, S);
    if (mm) std::memcpy(mm + dst * S, mm + src * S, S * sizeof(float));
  }
};

// x [M][d] (embedded tokens, in place -> decoder output before the final norm); row m is cache row m / n and
// writes its K/V at slot[m]; a query at slot p sees slots 0..p (the causal and per-row masks of model/cache.py).
static void decode_raw(float* x, int64_t M, int64_t n, int64_t d, const int64_t* slot,
                       const std::vector<StepLayer>& layers, const Cache& c) {
  Work& ws = work();
  int64_t ff = 0, max_slot = 0;
  for (const auto& w : layers) ff = std::max(ff, w.f1.N);
  for (int64_t m = 0; m < M; m++) max_slot = std::max(max_slot, slot[m]);
  TORCH_CHECK(max_slot < c.cap, "KV cache capacity ", c.cap, " exceeded (needs ", max_slot + 1, ")");
  float* y = grow(ws.y, M * d);
  float* big = grow(ws.big, M * std::max<int64_t>(3 * d, ff));
  float* a = grow(ws.a, M * d);
  float* o = grow(ws.o, M * d);
  const int64_t* ks = c.ks;
  const int64_t* ms = c.ms;
  const int64_t S = c.S, g = c.g;
  Tick tk;
  for (size_t li = 0; li < layers.size(); li++) {
    const StepLayer& w = layers[li];
    const int64_t h = w.n_heads, dh = d / h;
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    const float eps = (float)w.eps;
    // self-attention
    norm_rows(x, y, M, d, w.n1w.data_ptr<float>(), w.n1b.data_ptr<float>(), eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.qkv, y, big, M);                                               // [M][3][H][Dh]
    tk.to(P_DEC_LIN);
    float* kl = c.kv + li * ks[0];
    for (int64_t m = 0; m < M; m++) {
      const int64_t row = m / n;
      for (int64_t hh = 0; hh < h; hh++) {
        const float* src = big + m * 3 * d + hh * dh;
        std::memcpy(kl + row * ks[2] + hh * ks[3] + slot[m] * ks[4], src + d, dh * sizeof(float));
        std::memcpy(kl + ks[1] + row * ks[2] + hh * ks[3] + slot[m] * ks[4], src + 2 * d, dh * sizeof(float));
      }
    }
    const int64_t kmax = max_slot + 1, R = M / n;
    // one task per cache row and head: the row's n queries (a blockwise step's tokens) attend together
    at::parallel_for(0, R * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * kmax * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(n, kmax);
      float* scp = buf.sc;
      const float** qs = buf.q;
      float** os = buf.out;
      int64_t* lens = buf.len;
      for (int64_t i = lo; i < hi; i++) {
        const int64_t row = i / h, hh = i % h;
        for (int64_t j = 0; j < n; j++) {
          const int64_t m = row * n + j;
          qs[j] = big + m * 3 * d + hh * dh;
          os[j] = a + m * d + hh * dh;
          lens[j] = slot[m] + 1;
        }
        const float* base = kl + row * ks[2] + hh * ks[3];
        attend(n, qs, lens, base, base + ks[1], ks[4], nullptr, scale, os, dh, scp);
      }
    });
    tk.to(P_DEC_ATT);
    lin_rows(w.so, a, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    // cross-attention: row `row` reads memory row row / g
    norm_rows(x, y, M, d, w.n2w.data_ptr<float>(), w.n2b.data_ptr<float>(), eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.q, y, o, M);
    tk.to(P_DEC_LIN);
    const float* ml = c.mk + li * ms[0];
    const float* mm = c.mm;
    at::parallel_for(0, R * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * S * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(n, S);
      float* scp = buf.sc;
      const float** qs = buf.q;
      float** os = buf.out;
      int64_t* lens = buf.len;
      for (int64_t i = lo; i < hi; i++) {
        const int64_t row = i / h, hh = i % h, b = row / g;
        for (int64_t j = 0; j < n; j++) {
          const int64_t m = row * n + j;
          qs[j] = o + m * d + hh * dh;
          os[j] = a + m * d + hh * dh;
          lens[j] = S;
        }
        const float* base = ml + b * ms[2] + hh * ms[3];
        attend(n, qs, lens, base, base + ms[1], ms[4], mm ? mm + b * S : nullptr, scale, os, dh, scp);
      }
    });
    tk.to(P_DEC_ATT);
    lin_rows(w.co, a, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    // feed-forward
    norm_rows(x, y, M, d, w.n3w.data_ptr<float>(), w.n3b.data_ptr<float>(), eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.f1, y, big, M);
    for (int64_t i = 0; i < M * w.f1.N; i++) big[i] = std::max(big[i], 0.0f);
    lin_rows(w.f2, big, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    tk.to(P_DEC_OTHER);
  }
}

// write_index: per-row slots [2,R,H,n,Dh] (its [0,r,0,j,0] is token j's slot in row r; per-row cache mode),
// else token j goes to slot t + j of every row (uniform mode). self_mask is not read (decode_raw's rule is
// the same mask).
torch::Tensor decode_layers(torch::Tensor x_in, const std::vector<StepLayer>& layers, const torch::Tensor& self_kv,
                            const torch::Tensor& mem_kv, c10::optional<torch::Tensor> self_mask,
                            c10::optional<torch::Tensor> mem_mask, c10::optional<torch::Tensor> write_index, int64_t t,
                            int64_t kv_len, int64_t g) {
  (void)self_mask; (void)kv_len;
  const int64_t r = x_in.size(0), n = x_in.size(1), d = x_in.size(2), M = r * n;
  auto x_t = x_in.to(torch::kFloat32).contiguous().clone();
  std::vector<int64_t> slot(M);
  if (write_index.has_value()) {
    auto si = write_index->select(0, 0).select(1, 0).select(2, 0).contiguous();   // [R,n]
    const int64_t* sp = si.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; m++) slot[m] = sp[m];
  } else {
    for (int64_t m = 0; m < M; m++) slot[m] = t + m % n;
  }
  Cache c(self_kv, mem_kv, mem_mask, g);
  decode_raw(x_t.data_ptr<float>(), M, n, d, slot.data(), layers, c);
  return x_t;
}

// ---- the encoder for decoding, without ATen ops ----
// One encoder layer's weights (pre-norm layer, ReLU FFN: model/layers.py EncoderLayer).
struct EncLayer {
  int64_t n_heads;
  double eps;
  torch::Tensor n1w, n1b, n2w, n2b;
  Lin qkv, so, f1, f2;
  EncLayer(int64_t h, double e, torch::Tensor a, torch::Tensor b, Lin l1, Lin l2, torch::Tensor c, torch::Tensor d,
           Lin l3, Lin l4)
      : n_heads(h), eps(e), n1w(a), n1b(b), n2w(c), n2b(d), qkv(l1), so(l2), f1(l3), f2(l4) {}
};

// model/transformer.py encode at inference (pre-norm ReLU layers, then the final norm where there is one) on raw
// buffers: at batch 1 the encoder's ~20 ATen ops per layer cost more than its arithmetic (demo size, 25 tokens:
// ~2.5 ms through torch). x [B,S,d] the embedded sources; mask [B,S] additive (0 / -inf on padding) or none. Every
// query attends over all S keys (minus padding). The encoder is the same for every decoder, so its rounding (not
// torch's) is what greedy, blockwise and beam decoding all read.
static void encode_raw(float* x, int64_t B, int64_t S, int64_t d, const float* mm, const std::vector<EncLayer>& layers,
                       const c10::optional<torch::Tensor>& fnw, const c10::optional<torch::Tensor>& fnb, double feps) {
  const int64_t M = B * S;
  Work& ws = work();
  int64_t ff = 0;
  for (const auto& w : layers) ff = std::max(ff, w.f1.N);
  float* y = grow(ws.y, M * d);
  float* big = grow(ws.big, M * std::max<int64_t>(3 * d, ff));
  float* a = grow(ws.a, M * d);
  float* o = grow(ws.o, M * d);
  for (const EncLayer& w : layers) {
    const int64_t h = w.n_heads, dh = d / h;
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    norm_rows(x, y, M, d, w.n1w.data_ptr<float>(), w.n1b.data_ptr<float>(), (float)w.eps);
    lin_rows(w.qkv, y, big, M);                                               // [B][S][3][H][Dh]
    // one task per source and head: its S queries over its S keys
    at::parallel_for(0, B * h, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, S * S * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(S, S);
      for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i / h, hh = i % h;
        for (int64_t j = 0; j < S; j++) {
          buf.q[j] = big + (b * S + j) * 3 * d + hh * dh;
          buf.out[j] = a + (b * S + j) * d + hh * dh;
          buf.len[j] = S;
        }
        const float* kb = big + b * S * 3 * d + d + hh * dh;
        attend(S, buf.q, buf.len, kb, kb + d, 3 * d, mm ? mm + b * S : nullptr, scale, buf.out, dh, buf.sc);
      }
    });
    lin_rows(w.so, a, o, M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    norm_rows(x, y, M, d, w.n2w.data_ptr<float>(), w.n2b.data_ptr<float>(), (float)w.eps);
    lin_rows(w.f1, y, big, M);
    for (int64_t i = 0; i < M * w.f1.N; i++) big[i] = std::max(big[i], 0.0f);
    lin_rows(w.f2, big, o, M);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
  }
  if (fnw.has_value()) {
    norm_rows(x, y, M, d, fnw->data_ptr<float>(), fnb->data_ptr<float>(), (float)feps);
    std::memcpy(x, y, M * d * sizeof(float));
  }
}

// The encoder from the source ids [B,S] (right-padded with pad_id): the embedding as BPDModel._embed computes it
// (table[id] * scale, then + pe[position], two roundings) and the padding mask (none where nothing is padded, as
// BPDModel.encode passes), so a batch-1 call skips the ~6 ATen ops (and their Python) around the encoder.
// Returns (encoder output [B,S,d], whether any source is padded).
std::tuple<torch::Tensor, bool> encode_ids(torch::Tensor ids_in, torch::Tensor table, double scale, torch::Tensor pe, int64_t pad_id,
                         const std::vector<EncLayer>& layers, c10::optional<torch::Tensor> fnw,
                         c10::optional<torch::Tensor> fnb, double feps) {
  TORCH_CHECK(ids_in.dim() == 2, "encode_ids: ids must be [B,S]");
  TORCH_CHECK(table.is_contiguous() && pe.is_contiguous() && table.scalar_type() == torch::kFloat32 &&
              pe.scalar_type() == torch::kFloat32 && pe.size(1) == table.size(1), "encode_ids: fp32 tables");
  const auto ids_t = ids_in.to(torch::kLong).contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const int64_t B = ids_t.size(0), S = ids_t.size(1), d = table.size(1), V = table.size(0);
  TORCH_CHECK(S <= pe.size(0), "encode_ids: source longer than the position table");
  auto x_t = torch::empty({B, S, d}, table.options());
  float* x = x_t.data_ptr<float>();
  const float* e = table.data_ptr<float>();
  const float* pp = pe.data_ptr<float>();
  const float sc = (float)scale;
  bool padded = false;
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = 0; j < S; j++) {
      const int64_t id = ids[b * S + j];
      TORCH_CHECK(id >= 0 && id < V, "encode_ids: token id ", id, " outside the vocabulary of ", V);
      padded |= id == pad_id;
      const float* er = e + id * d;
      const float* pr = pp + j * d;
      float* xr = x + (b * S + j) * d;
      for (int64_t i = 0; i < d; i++) {
        const float v = er[i] * sc;
        xr[i] = v + pr[i];
      }
    }
  std::vector<float> mask;
  if (padded) {
    mask.assign(B * S, 0.0f);
    for (int64_t i = 0; i < B * S; i++)
      if (ids[i] == pad_id) mask[i] = -std::numeric_limits<float>::infinity();
  }
  encode_raw(x, B, S, d, padded ? mask.data() : nullptr, layers, fnw, fnb, feps);
  return {x_t, padded};
}

// Each decoder layer's cross-attention keys and values of the encoder output (BPDModel.start_decoding): out
// [B,S,d], kv[l] the layer's packed [2d, d] projection. Returns mem_kv [L,2,B,H,S,Dh] (model/cache.py's layout).
torch::Tensor memory_kv(torch::Tensor out_in, const std::vector<Lin>& kv, int64_t n_heads) {
  const int64_t B = out_in.size(0), S = out_in.size(1), d = out_in.size(2), M = B * S, Ln = (int64_t)kv.size();
  const int64_t dh = d / n_heads;
  auto xin = out_in.to(torch::kFloat32).contiguous();
  auto res = torch::empty({Ln, 2, B, n_heads, S, dh}, xin.options());
  float* r = res.data_ptr<float>();
  float* tmp = grow(work().big, M * 2 * d);
  for (int64_t l = 0; l < Ln; l++) {
    lin_rows(kv[l], xin.data_ptr<float>(), tmp, M);                          // [B][S][2][H][Dh]
    for (int64_t m = 0; m < M; m++) {
      const int64_t b = m / S, s = m % S;
      for (int64_t t = 0; t < 2; t++)
        for (int64_t hh = 0; hh < n_heads; hh++)
          std::memcpy(r + ((((l * 2 + t) * B + b) * n_heads + hh) * S + s) * dh, tmp + m * 2 * d + t * d + hh * dh,
                      dh * sizeof(float));
    }
  }
  return res;
}

// The embedding a decode step feeds, as BPDModel.decode computes it: embed[tok] * scale, then + pe[pos], two
// roundings (the extension is built with -ffp-contract=off, so no fused multiply-add merges them).
struct Embed {
  const float* e;
  const float* pe;
  float scale;
  int64_t d, max_pos;
  Embed(const torch::Tensor& embed, double s, const torch::Tensor& pe_, int64_t mp)
      : e(embed.data_ptr<float>()), pe(pe_.data_ptr<float>()), scale((float)s), d(embed.size(1)), max_pos(mp) {
    TORCH_CHECK(embed.is_contiguous() && pe_.is_contiguous() && embed.scalar_type() == torch::kFloat32 &&
                pe_.scalar_type() == torch::kFloat32, "embedding tables must be contiguous float32");
  }
  void rows(const int64_t* tok, const int64_t* slot, int64_t M, float* x) const {
    for (int64_t m = 0; m < M; m++) {
      const float* er = e + tok[m] * d;
      const float* pr = pe + std::min(slot[m], max_pos - 1) * d;
      float* xr = x + m * d;
      for (int64_t i = 0; i < d; i++) {
        const float v = er[i] * scale;
        xr[i] = v + pr[i];
      }
    }
  }
};

// Heads lo..lo+n_heads-1 at M positions h [M][D] -> argmax ids [M][n_heads] (draft ids mapped back):
// state_i = h + fc2(relu(fc1(h)))[slice i]; logits = proj(layer_norm(state_i)). Proposals only decide what is
// verified, so their rounding never reaches the output.
static void propose_raw(const float* h, int64_t M, int64_t d, const Lin& fc1, const Lin& fc2, int64_t n_heads,
                        const float* nw, const float* nb, float eps, const Lin& proj, const int64_t* draft,
                        int64_t* out) {
  Work& ws = work();
  Tick tk;
  float* hid = grow(ws.hid, M * fc1.N);
  float* st = grow(ws.st, M * n_heads * d);
  float* y = grow(ws.sy, M * n_heads * d);
  int64_t* ids = grow(ws.pids, M * n_heads);
  lin_rows(fc1, h, hid, M);
  for (int64_t i = 0; i < M * fc1.N; i++) hid[i] = std::max(hid[i], 0.0f);
  lin_rows(fc2, hid, st, M);                                                 // [M][n_heads][D]
  for (int64_t m = 0; m < M; m++)
    for (int64_t i = 0; i < n_heads * d; i++) st[m * n_heads * d + i] += h[m * d + i % d];
  norm_rows(st, y, M * n_heads, d, nw, nb, eps);
  tk.to(P_HEADS_FFN);
  project_ids(y, M * n_heads, proj, ids, false, ws.plog);
  for (int64_t m = 0; m < M * n_heads; m++) out[m] = draft ? draft[ids[m]] : ids[m];
  tk.to(P_PROPOSE_PROJ);
}

// Chained heads (model/heads.py ChainHeads): head i reads the decoder state h and the embedding of the token before
// its own -- head 1's token for head 2, then each head's own argmax for the next -- through its own FFN:
// x = h + tok_i(emb[prev] * scale), state_i = h + fc2_i(relu(fc1_i(x))), logits = proj(layer_norm(state_i)).
struct ChainProp {
  std::vector<Lin> tok, fc1, fc2;            // heads 2..k: P_i (no bias), W1_i, W2_i
  torch::Tensor emb;                         // [V][D] float32: the decoder's token embedding
  float scale;
  ChainProp(std::vector<Lin> t, std::vector<Lin> f1, std::vector<Lin> f2, torch::Tensor e, double s)
      : tok(std::move(t)), fc1(std::move(f1)), fc2(std::move(f2)), emb(e.contiguous()), scale((float)s) {
    TORCH_CHECK(tok.size() == fc1.size() && tok.size() == fc2.size(), "ChainProp: one tok, fc1, fc2 per head");
    TORCH_CHECK(emb.scalar_type() == torch::kFloat32 && emb.dim() == 2, "ChainProp: emb must be float32 [V, D]");
  }
};

// Chained heads 1..n_heads (0-based: head 1 predicts 2 ahead) at M positions h [M][D], first [M] the token before
// head 1's target (head 0's, i.e. the base model's next token) -> argmax ids [M][n_heads] (draft ids mapped back).
static void propose_chain_raw(const float* h, int64_t M, int64_t d, const ChainProp& c, const int64_t* first,
                              int64_t n_heads, const float* nw, const float* nb, float eps, const Lin& proj,
                              const int64_t* draft, int64_t* out) {
  TORCH_CHECK(n_heads <= (int64_t)c.tok.size(), "propose: ", n_heads, " heads asked of ", c.tok.size(), " chained heads");
  Work& ws = work();
  Tick tk;
  float* e = grow(ws.ce, M * d);
  float* x = grow(ws.cx, M * d);
  float* st = grow(ws.st, M * d);
  float* y = grow(ws.sy, M * d);
  int64_t* ids = grow(ws.pids, M);
  int64_t* prev = grow(ws.cprev, M);
  std::memcpy(prev, first, M * sizeof(int64_t));
  const float* ew = c.emb.data_ptr<float>();
  for (int64_t i = 0; i < n_heads; i++) {
    const Lin &P = c.tok[i], &F1 = c.fc1[i], &F2 = c.fc2[i];
    float* hid = grow(ws.hid, M * F1.N);
    for (int64_t m = 0; m < M; m++) {
      const float* er = ew + prev[m] * d;
      for (int64_t j = 0; j < d; j++) e[m * d + j] = er[j] * c.scale;
    }
    lin_rows(P, e, x, M);
    for (int64_t j = 0; j < M * d; j++) x[j] += h[j];
    lin_rows(F1, x, hid, M);
    for (int64_t j = 0; j < M * F1.N; j++) hid[j] = std::max(hid[j], 0.0f);
    lin_rows(F2, hid, st, M);
    for (int64_t j = 0; j < M * d; j++) st[j] += h[j];
    norm_rows(st, y, M, d, nw, nb, eps);
    tk.to(P_HEADS_FFN);
    project_ids(y, M, proj, ids, false, ws.plog);
    for (int64_t m = 0; m < M; m++) {
      const int64_t best = ids[m];
      const int64_t id = draft ? draft[best] : best;
      out[m * n_heads + i] = id;
      prev[m] = id;
    }
    tk.to(P_PROPOSE_PROJ);
  }
}

torch::Tensor propose_chain(const torch::Tensor& h_in, const torch::Tensor& first_in, const ChainProp& c,
                            int64_t n_heads, const torch::Tensor& nw, const torch::Tensor& nb, double eps,
                            const Lin& proj, c10::optional<torch::Tensor> draft_ids) {
  const int64_t d = h_in.size(-1);
  auto h_t = h_in.to(torch::kFloat32).contiguous();
  const int64_t M = h_t.numel() / d;
  auto first = first_in.to(torch::kLong).contiguous();
  TORCH_CHECK(first.numel() == M, "propose_chain: one first token per position (", M, "), got ", first.numel());
  auto shape = h_t.sizes().vec();
  shape.back() = n_heads;
  auto ids = torch::empty(shape, h_t.options().dtype(torch::kLong));
  torch::Tensor dids;
  if (draft_ids.has_value()) dids = draft_ids->to(torch::kLong).contiguous();
  propose_chain_raw(h_t.data_ptr<float>(), M, d, c, first.data_ptr<int64_t>(), n_heads, nw.data_ptr<float>(),
                    nb.data_ptr<float>(), (float)eps, proj, dids.defined() ? dids.data_ptr<int64_t>() : nullptr,
                    ids.data_ptr<int64_t>());
  return ids;
}

torch::Tensor propose(const torch::Tensor& h_in, const Lin& fc1, const Lin& fc2, int64_t n_heads,
                      const torch::Tensor& nw, const torch::Tensor& nb, double eps, const Lin& proj,
                      c10::optional<torch::Tensor> draft_ids) {
  const int64_t d = h_in.size(-1);
  auto h_t = h_in.to(torch::kFloat32).contiguous();
  const int64_t M = h_t.numel() / d;
  auto shape = h_t.sizes().vec();
  shape.back() = n_heads;
  auto ids = torch::empty(shape, h_t.options().dtype(torch::kLong));
  torch::Tensor dids;
  if (draft_ids.has_value()) dids = draft_ids->to(torch::kLong).contiguous();
  propose_raw(h_t.data_ptr<float>(), M, d, fc1, fc2, n_heads, nw.data_ptr<float>(), nb.data_ptr<float>(), (float)eps,
              proj, dids.defined() ? dids.data_ptr<int64_t>() : nullptr, ids.data_ptr<int64_t>());
  return ids;
}

// ---- the native loops, generic over the model they run ----
// What greedy_steps / block_steps / batch_block_steps call per step: embed the fed tokens, run the layer stack,
// head 1's argmax, the proposals of heads 1..n. Two kinds: the encoder-decoder stack above (EncDecLoop) and the
// decoder-only (Llama-style) stack below (LMLoop). One virtual call per phase and step (nothing per row).
struct LoopModel {
  int64_t d = 0;
  std::vector<int64_t> stops;                   // the ids that end a row (decoder-only checkpoints list several)
  bool stop(int64_t t) const {
    for (int64_t s : stops) if (s == t) return true;
    return false;
  }
  virtual ~LoopModel() = default;
  virtual void embed(const int64_t* tok, const int64_t* slot, int64_t M, float* x) const = 0;
  // x [M][d] in place; row m is cache row m / n, at slot[m]
  virtual void layers(float* x, int64_t M, int64_t n, const int64_t* slot) const = 0;
  // head 1's argmax at M positions; its logits stay in work().logits ([M][vocab()]) until the next call
  virtual void head1(const float* h, int64_t M, int64_t* out) const = 0;
  virtual int64_t vocab() const = 0;
  // the acceptance rule (decoding/acceptance.py, set by the entry points): Exact; TopK(n) for top_n >= 1 (fewer
  // than n of head 1's logits strictly above the proposal's); Distance(eps) for dist_eps >= 0 (|p - g| <= eps)
  int64_t top_n = 0;
  double dist_eps = -1.0;
  void set_rule(int64_t n, double eps) {
    TORCH_CHECK(n >= 0 && !(n > 0 && eps >= 0), "blockwise steps: one rule: top_n >= 1 or dist_eps >= 0 or neither");
    top_n = n;
    dist_eps = eps;
  }
  // is proposal p accepted where head 1's token is g and row `row` of the last head1 call holds its logits
  bool accepts(int64_t p, int64_t g, int64_t row) const {
    if (top_n > 0) {
      const int64_t V = vocab();
      if (p < 0 || p >= V) return false;
      const float* l = work().logits.data() + row * V;
      const float lp = l[p];
      int64_t above = 0;
      for (int64_t v = 0; v < V; v++) above += l[v] > lp;
      return above < top_n;
    }
    if (dist_eps >= 0) return std::fabs((double)(p - g)) <= dist_eps;
    return p == g;
  }
  // heads 1..n_heads at M positions -> ids [M][n_heads]; first [M]: head 1's token at each (chained heads read it)
  virtual void propose(const float* h, int64_t M, int64_t n_heads, const int64_t* first, int64_t* out) const = 0;
  // cache row dst = cache row src (its first `filled` self-cache slots), for loops that drop finished rows
  // themselves; false where this model's cache cannot (the caller then returns when a row ends)
  virtual bool move_row(int64_t, int64_t, int64_t) const { return false; }
};

static std::vector<int64_t> stop_list(const torch::Tensor& stops) {
  auto s = stops.to(torch::kLong).contiguous();
  return std::vector<int64_t>(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
}

struct EncDecLoop : LoopModel {
  const Embed emb;
  const std::vector<StepLayer>& ls;
  const Cache c;
  const float* nw;
  const float* nb;
  float eps;
  const Lin& proj;
  const Lin* fc1 = nullptr;
  const Lin* fc2 = nullptr;
  const Lin* draft = nullptr;
  const int64_t* dp = nullptr;
  const ChainProp* chain = nullptr;           // chained heads instead of fc1 / fc2
  EncDecLoop(const torch::Tensor& embed, double embed_scale, const torch::Tensor& pe, int64_t max_positions,
             const std::vector<StepLayer>& layers, const torch::Tensor& self_kv, const torch::Tensor& mem_kv,
             const c10::optional<torch::Tensor>& mem_mask, int64_t g, const torch::Tensor& nw_,
             const torch::Tensor& nb_, double eps_, const Lin& proj_, int64_t eos)
      : emb(embed, embed_scale, pe, max_positions), ls(layers), c(self_kv, mem_kv, mem_mask, g),
        nw(nw_.data_ptr<float>()), nb(nb_.data_ptr<float>()), eps((float)eps_), proj(proj_) {
    d = embed.size(1);
    stops = {eos};
  }
  void embed(const int64_t* tok, const int64_t* slot, int64_t M, float* x) const override { emb.rows(tok, slot, M, x); }
  void layers(float* x, int64_t M, int64_t n, const int64_t* slot) const override { decode_raw(x, M, n, d, slot, ls, c); }
  void head1(const float* h, int64_t M, int64_t* out) const override {
    head1_ids(h, M, d, nw, nb, eps, proj, out, top_n > 0);
  }
  int64_t vocab() const override { return proj.N; }
  bool move_row(int64_t dst, int64_t src, int64_t filled) const override {
    if (c.g != 1) return false;
    c.move_row(dst, src, filled);
    return true;
  }
  void propose(const float* h, int64_t M, int64_t n_heads, const int64_t* first, int64_t* out) const override {
    if (chain) propose_chain_raw(h, M, d, *chain, first, n_heads, nw, nb, eps, *draft, dp, out);
    else propose_raw(h, M, d, *fc1, *fc2, n_heads, nw, nb, eps, *draft, dp, out);
  }
};

// Greedy steps for R rows in one call (small models spend more in per-step Python than in arithmetic):
// embed the fed tokens, run the decoder stack, take head 1's argmax, feed it back; stop after `max_steps`
// steps or after the step in which a row ends (a stop id, or its `room` tokens are used up), so the caller drops
// finished rows exactly where its Python loop would. Every op is the one the model's decode and
// DecodeWeights.head1_argmax run, in the same order, so the tokens are those of the one-step path.
// slot: each row's first slot. Returns (tokens [R, steps] int64, decoder output of the last step [R, D] before the
// final norm, seconds the steps took: what adaptive blockwise compares step widths by, without the Python call).
// to_end: run until every row has ended (or max_steps), finished rows leaving the loop's rows as they end (the
// last row's cache moved into each freed place, LoopModel::move_row): one call for a whole batch where returning
// at every row's end cost a Python round trip and a cache reorder each (~9% of greedy's time at batch 32, demo
// size). The caches are left rearranged: the caller drops the state. Rows are independent (every row runs the same
// instructions whatever its place or its batch mates), so the tokens are the same. Returns (tokens [R, steps],
// each row's steps [R] int64, seconds).
static std::tuple<torch::Tensor, torch::Tensor, double> greedy_loop(
    const LoopModel& mdl, const torch::Tensor& tok, std::vector<int64_t> slot, const torch::Tensor& room,
    int64_t max_steps, std::chrono::steady_clock::time_point t_start, bool to_end = false) {
  const int64_t r = tok.size(0), d = mdl.d;
  TORCH_CHECK(room.numel() == r && room.scalar_type() == torch::kLong, "greedy_steps: room must be int64 [R]");
  auto rm = room.contiguous();
  std::vector<int64_t> rooms(rm.data_ptr<int64_t>(), rm.data_ptr<int64_t>() + r);
  auto tk0 = tok.to(torch::kLong).contiguous();
  std::vector<int64_t> x(tk0.data_ptr<int64_t>(), tk0.data_ptr<int64_t>() + r), nxt(r), id(r), fin(r, 0);
  for (int64_t i = 0; i < r; i++) id[i] = i;
  auto out = torch::zeros({r, std::max<int64_t>(max_steps, 0)}, tk0.options());
  int64_t* outp = out.data_ptr<int64_t>();
  auto ends = torch::zeros({r}, tk0.options());
  int64_t* endp = ends.data_ptr<int64_t>();
  auto last = torch::empty({r, d}, torch::TensorOptions().dtype(torch::kFloat32));
  std::vector<float> h(r * d);
  int64_t s = 0, act = r;                        // act: rows still decoding (the first act of x, slot, id, ...)
  Tick tk;
  while (s < max_steps && act > 0) {
    mdl.embed(x.data(), slot.data(), act, h.data());
    tk.to(P_EMBED);
    mdl.layers(h.data(), act, 1, slot.data());
    tk = Tick();
    mdl.head1(h.data(), act, nxt.data());
    tk.to(P_VERIFY);
    bool ended = false;
    for (int64_t i = 0; i < act; i++) {
      outp[id[i] * max_steps + s] = nxt[i];
      fin[i] = mdl.stop(nxt[i]) || rooms[i] <= s + 1;
      ended |= fin[i] != 0;
      slot[i] += 1;
    }
    s += 1;
    if (g_prof) g_prof_steps += 1;
    if (!to_end) {
      x = nxt;
      if (ended) break;
      continue;
    }
    for (int64_t i = 0; i < act; i++) x[i] = nxt[i];
    for (int64_t i = 0; i < act;) {              // finished rows leave: the last row takes each freed place
      if (!fin[i]) { i++; continue; }
      endp[id[i]] = s;
      act -= 1;
      if (i == act) break;
      TORCH_CHECK(mdl.move_row(i, act, slot[act]), "greedy_steps: to_end on a cache whose rows cannot move");
      x[i] = x[act];
      slot[i] = slot[act];
      id[i] = id[act];
      rooms[i] = rooms[act];
      fin[i] = fin[act];
    }
  }
  if (to_end) {
    for (int64_t i = 0; i < act; i++) endp[id[i]] = s;   // max_steps reached
    return {out.narrow(1, 0, s), ends,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()};
  }
  if (s > 0) std::memcpy(last.data_ptr<float>(), h.data(), r * d * sizeof(float));
  return {out.narrow(1, 0, s), last, std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()};
}

// Cache modes as model/cache.py: `lengths` None -> uniform, the new token at slot t of every row; else
// per-row lengths [R] (int64, slots counted after the `t` prefix slots) -> slot t + lengths[r].
static std::vector<int64_t> first_slots(int64_t r, int64_t t, const c10::optional<torch::Tensor>& lengths) {
  std::vector<int64_t> slot(r, t);
  if (lengths.has_value()) {
    auto l = lengths->to(torch::kLong).contiguous();
    for (int64_t i = 0; i < r; i++) slot[i] = t + l.data_ptr<int64_t>()[i];
  }
  return slot;
}

std::tuple<torch::Tensor, torch::Tensor, double> greedy_steps(
    torch::Tensor tok, const torch::Tensor& embed, double embed_scale, const torch::Tensor& pe, int64_t max_positions,
    const std::vector<StepLayer>& layers, const torch::Tensor& self_kv, const torch::Tensor& mem_kv,
    c10::optional<torch::Tensor> mem_mask, int64_t g, int64_t t, c10::optional<torch::Tensor> lengths,
    const torch::Tensor& nw, const torch::Tensor& nb, double eps, const Lin& proj, int64_t eos, torch::Tensor room,
    int64_t max_steps, bool to_end) {
  const auto t_start = std::chrono::steady_clock::now();
  TORCH_CHECK(!to_end || g == 1, "greedy_steps: to_end needs rows that do not share memory rows");
  const EncDecLoop mdl(embed, embed_scale, pe, max_positions, layers, self_kv, mem_kv, mem_mask, g, nw, nb, eps, proj,
                       eos);
  return greedy_loop(mdl, tok, first_slots(tok.size(0), t, lengths), room, max_steps, t_start, to_end);
}

// Blockwise steps for ONE row in uniform cache mode (decoding/blockwise.py at batch 1; the Exact, TopK or Distance
// rule, LoopModel::accepts), in one call with no ATen op or allocation per step: feed x (x0 + w-1 proposals) at
// slots t.., verify, accept the longest prefix of proposals the rule passes against head 1 (nothing after a stop
// id), then heads 1..w-1 propose at the accepted position. x0 itself is never taken for a stop: it is the token
// accepted last (or, in a decoder-only model's prefill, the prompt's last token, which may well be an end-of-turn
// id). Verification is lazy: head 1's logits are computed `group` positions at a time, and only as far as
// proposals are accepted (a rejected proposal makes the positions after it irrelevant), so a step whose first
// proposal fails projects `group` rows, not w. Each row's logits are computed by the same instructions whatever the
// group, so the tokens are those of the one-step loop (and, Exact, of greedy decoding).
// Stops after `max_steps` steps or the step in which the row ends (a stop id, or `room` tokens used up).
// x may be narrower than `width`, the block fed from the second step on (the prefill feeds BOS alone: its
// head-1 token and proposals come out of the same loop, not out of a Python step).
// Returns (tokens gained, in order; per step: proposals accepted n and tokens gained c; next fed tokens [width];
// decoder output at the last accepted position [D]; 1 if the row ended; seconds, as greedy_steps).
static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double> block_loop(
    const LoopModel& mdl, torch::Tensor x_in, int64_t t, int64_t room, int64_t max_steps, int64_t group, int64_t width,
    std::chrono::steady_clock::time_point t_start) {
  auto xt = x_in.to(torch::kLong).contiguous();
  const int64_t w0 = xt.numel(), d = mdl.d;
  const int64_t pad = mdl.stops.empty() ? -1 : mdl.stops[0];   // fills the next block where no proposal runs
  group = std::max<int64_t>(1, group);
  width = std::max<int64_t>(1, width);
  const int64_t wm = std::max(w0, width);
  std::vector<int64_t> x(xt.data_ptr<int64_t>(), xt.data_ptr<int64_t>() + w0), toks, nc, slot(wm), gh(wm), prop(wm);
  auto lopt = torch::TensorOptions().dtype(torch::kLong);
  std::vector<float> h(wm * d), hn(d, 0.0f);
  int64_t ended = 0;
  for (int64_t s = 0; s < max_steps && !ended; s++) {
    const int64_t w = (int64_t)x.size();   // the first step may feed another width (the prefill: BOS alone)
    Tick tk;
    for (int64_t j = 0; j < w; j++) slot[j] = t + j;
    mdl.embed(x.data(), slot.data(), w, h.data());
    tk.to(P_EMBED);
    mdl.layers(h.data(), w, w, slot.data());
    tk = Tick();
    int64_t n = 0, done = 0, first = 0;                    // first: the position of the last head1 call's row 0
    for (;;) {
      if (n >= done) {                                     // head 1 at the next `group` positions
        const int64_t rows = std::min(group, w - done);
        mdl.head1(h.data() + done * d, rows, gh.data() + done);
        first = done;
        done += rows;
      }
      if (n < w - 1 && mdl.accepts(x[n + 1], gh[n], n - first) && (n == 0 || !mdl.stop(x[n]))) n++;
      else break;
    }
    tk.to(P_VERIFY);
    const int64_t gn = gh[n];
    const bool eos_in = n > 0 && mdl.stop(x[n]);
    const int64_t cnt = std::min<int64_t>(n + 1 - (eos_in ? 1 : 0), room);
    for (int64_t j = 0; j < cnt; j++) toks.push_back(j < n ? x[j + 1] : gn);
    nc.push_back(n);
    nc.push_back(cnt);
    room -= cnt;
    t += cnt;
    ended = (eos_in || mdl.stop(gn) || room <= 0) ? 1 : 0;
    std::memcpy(hn.data(), h.data() + n * d, d * sizeof(float));
    x.assign(width, pad);
    x[0] = gn;
    if (!ended && width > 1) {
      mdl.propose(hn.data(), 1, width - 1, &gn, prop.data());
      for (int64_t j = 0; j < width - 1; j++) x[j + 1] = prop[j];
    }
    if (g_prof) g_prof_steps += 1;
  }
  auto cp = [&](const std::vector<int64_t>& v) {
    return torch::from_blob(const_cast<int64_t*>(v.data()), {(int64_t)v.size()}, lopt).clone();
  };
  auto hn_t = torch::from_blob(hn.data(), {d}, torch::TensorOptions().dtype(torch::kFloat32)).clone();
  return {cp(toks), cp(nc).view({-1, 2}), cp(x), hn_t, ended,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double> block_steps(
    torch::Tensor x_in, const torch::Tensor& embed, double embed_scale, const torch::Tensor& pe, int64_t max_positions,
    const std::vector<StepLayer>& layers, const torch::Tensor& self_kv, const torch::Tensor& mem_kv,
    c10::optional<torch::Tensor> mem_mask, int64_t t, const torch::Tensor& nw, const torch::Tensor& nb, double eps,
    const Lin& proj, const Lin* fc1, const Lin* fc2, const Lin& draft_proj, c10::optional<torch::Tensor> draft_ids,
    int64_t eos, int64_t room, int64_t max_steps, int64_t group, int64_t width, const ChainProp* chain, int64_t top_n,
    double dist_eps) {
  const auto t_start = std::chrono::steady_clock::now();
  EncDecLoop mdl(embed, embed_scale, pe, max_positions, layers, self_kv, mem_kv, mem_mask, 1, nw, nb, eps, proj, eos);
  mdl.set_rule(top_n, dist_eps);
  torch::Tensor dids;
  if (draft_ids.has_value()) dids = draft_ids->to(torch::kLong).contiguous();
  TORCH_CHECK(chain != nullptr || (fc1 != nullptr && fc2 != nullptr), "blockwise steps: no proposal heads given");
  mdl.fc1 = fc1;
  mdl.fc2 = fc2;
  mdl.chain = chain;
  mdl.draft = &draft_proj;
  mdl.dp = dids.defined() ? dids.data_ptr<int64_t>() : nullptr;
  return block_loop(mdl, x_in, t, room, max_steps, group, width, t_start);
}

// Blockwise steps for R rows in per-row cache mode (decoding/blockwise.py at batch > 1, any rule accepts()): the
// batched block_steps. Row r feeds x[r] (its last accepted token + w-1 proposals) at slots t + lengths[r] ..; head 1
// verifies lazily, `group` positions of every row still accepting at a time (rows whose proposal was rejected are
// not projected further); each row accepts its longest agreeing prefix (nothing after a stop id) and gains n+1 tokens
// (capped by its room); heads 1..width-1 propose at every live row's accepted position. All rows take the same
// steps: the loop stops after `max_steps` steps or after the step in which a row ends, so the caller drops finished
// rows where its Python loop would. Each token's decoder output, head-1 logits and proposals are computed by the
// same instructions as in greedy_steps / block_steps (rows are independent), so with Exact the output is greedy's.
// Returns (tokens gained per row [R, max_steps*width] (the first counts[r] valid), per row and step (n, c) [R, s, 2],
// next fed tokens [R, width], decoder output at each row's last accepted position [R, D], ended [R], seconds).
static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double> batch_block_loop(
    const LoopModel& mdl, torch::Tensor x_in, int64_t t, torch::Tensor lengths, torch::Tensor room_in,
    int64_t max_steps, int64_t group, int64_t width, std::chrono::steady_clock::time_point t_start,
    bool to_end = false) {
  auto xt = x_in.to(torch::kLong).contiguous();
  TORCH_CHECK(xt.dim() == 2, "batch_block_steps: x must be [R, w]");
  const int64_t R0 = xt.size(0), d = mdl.d;
  int64_t R = R0;                                 // rows still decoding (to_end: the first R of the per-row arrays)
  const int64_t pad = mdl.stops.empty() ? -1 : mdl.stops[0];
  int64_t w = xt.size(1);
  group = std::max<int64_t>(1, group);
  width = std::max<int64_t>(1, width);
  const int64_t wm = std::max(w, width);
  auto lt = lengths.to(torch::kLong).contiguous();
  auto rt = room_in.to(torch::kLong).contiguous();
  TORCH_CHECK(lt.numel() == R && rt.numel() == R, "batch_block_steps: lengths and room must be [R]");
  std::vector<int64_t> x(xt.data_ptr<int64_t>(), xt.data_ptr<int64_t>() + R * w), len(lt.data_ptr<int64_t>(),
      lt.data_ptr<int64_t>() + R), room(rt.data_ptr<int64_t>(), rt.data_ptr<int64_t>() + R);
  std::vector<int64_t> slot(R * wm), gh(R * wm), n(R), cnt(R, 0), act, nact, prop(R * wm), live, id(R);
  std::vector<int64_t> nc, hist(wm + 1, 0);       // (to_end: tokens gained per row and step, counted)
  for (int64_t r = 0; r < R; r++) id[r] = r;
  auto lopt = torch::TensorOptions().dtype(torch::kLong);
  const int64_t tw = std::max<int64_t>(max_steps, 0) * wm;
  auto toks = torch::zeros({R, std::max<int64_t>(tw, 1)}, lopt);
  int64_t* tp = toks.data_ptr<int64_t>();
  std::vector<float> h(R * wm * d), hv(R * wm * d), hn(R * d, 0.0f);
  std::vector<int64_t> ended(R, 0);
  bool any_ended = false;
  int64_t s = 0;
  for (; s < max_steps && !any_ended && R > 0; s++) {
    Tick tk;
    for (int64_t r = 0; r < R; r++)
      for (int64_t j = 0; j < w; j++) slot[r * w + j] = t + len[r] + j;
    mdl.embed(x.data(), slot.data(), R * w, h.data());
    tk.to(P_EMBED);
    mdl.layers(h.data(), R * w, w, slot.data());
    tk = Tick();
    // lazy verification: head 1 at positions done..done+cols-1 of the rows that accepted every proposal so far
    act.resize(R);
    for (int64_t r = 0; r < R; r++) { act[r] = r; n[r] = 0; }
    int64_t done = 0;
    while (!act.empty()) {
      const int64_t cols = std::min(group, w - done);
      const int64_t A = (int64_t)act.size();
      for (int64_t a = 0; a < A; a++)
        std::memcpy(hv.data() + a * cols * d, h.data() + (act[a] * w + done) * d, cols * d * sizeof(float));
      mdl.head1(hv.data(), A * cols, prop.data());
      nact.clear();
      for (int64_t a = 0; a < A; a++) {
        const int64_t r = act[a];
        const int64_t* xr = x.data() + r * w;
        for (int64_t j = 0; j < cols; j++) gh[r * w + done + j] = prop[a * cols + j];
        int64_t m = n[r];
        while (m < done + cols && m < w - 1 && mdl.accepts(xr[m + 1], gh[r * w + m], a * cols + m - done) &&
               (m == 0 || !mdl.stop(xr[m])))
          m++;
        n[r] = m;
        if (m == done + cols && m < w) nact.push_back(r);   // head 1 is needed at position m: the next group
      }
      done += cols;
      act.swap(nact);
    }
    tk.to(P_VERIFY);
    live.clear();
    for (int64_t r = 0; r < R; r++) {
      const int64_t* xr = x.data() + r * w;
      const int64_t m = n[r], gn = gh[r * w + m];
      const bool eos_in = m > 0 && mdl.stop(xr[m]);
      const int64_t cn = std::min<int64_t>(m + 1 - (eos_in ? 1 : 0), room[r]);
      for (int64_t j = 0; j < cn; j++) tp[id[r] * tw + cnt[id[r]] + j] = j < m ? xr[j + 1] : gn;
      cnt[id[r]] += cn;
      if (to_end) {
        hist[cn] += 1;
      } else {
        nc.push_back(m);
        nc.push_back(cn);
      }
      room[r] -= cn;
      len[r] += cn;
      ended[r] = (eos_in || mdl.stop(gn) || room[r] <= 0) ? 1 : 0;
      any_ended |= ended[r] != 0 && !to_end;
      std::memcpy(hn.data() + r * d, h.data() + (r * w + m) * d, d * sizeof(float));
      prop[r] = gn;                                        // (prop reused: head 1's tokens until x is rebuilt)
      if (!ended[r]) live.push_back(r);
    }
    std::vector<int64_t> gnv(prop.begin(), prop.begin() + R);
    x.assign(R * width, pad);
    for (int64_t r = 0; r < R; r++) x[r * width] = gnv[r];
    w = width;
    if (width > 1 && !live.empty()) {
      const int64_t A = (int64_t)live.size();
      for (int64_t a = 0; a < A; a++) std::memcpy(hv.data() + a * d, hn.data() + live[a] * d, d * sizeof(float));
      std::vector<int64_t> first(A);
      for (int64_t a = 0; a < A; a++) first[a] = gnv[live[a]];
      mdl.propose(hv.data(), A, width - 1, first.data(), prop.data());
      for (int64_t a = 0; a < A; a++)
        for (int64_t j = 0; j < width - 1; j++) x[live[a] * width + j + 1] = prop[a * (width - 1) + j];
    }
    if (g_prof) g_prof_steps += 1;
    if (to_end) {                                  // finished rows leave: the last row takes each freed place
      for (int64_t r = 0; r < R;) {
        if (!ended[r]) { r++; continue; }
        R -= 1;
        if (r == R) break;
        TORCH_CHECK(mdl.move_row(r, R, t + len[R]), "batch_block_steps: to_end on a cache whose rows cannot move");
        std::memcpy(x.data() + r * width, x.data() + R * width, width * sizeof(int64_t));
        len[r] = len[R];
        room[r] = room[R];
        id[r] = id[R];
        ended[r] = ended[R];
      }
    }
  }
  if (to_end) {   // (tokens [R0, T] of which the first counts[r] are row r's, histogram of tokens per step, counts)
    return {toks.narrow(1, 0, std::max<int64_t>(tw, 1)), torch::tensor(hist, lopt), torch::tensor(std::vector<int64_t>{s}, lopt),
            torch::empty({0}, torch::TensorOptions().dtype(torch::kFloat32)), torch::tensor(cnt, lopt),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()};
  }
  auto ncv = torch::from_blob(nc.data(), {s, R, 2}, lopt).permute({1, 0, 2}).clone(at::MemoryFormat::Contiguous);
  auto xo = torch::from_blob(x.data(), {R, w}, lopt).clone();
  auto hn_t = torch::from_blob(hn.data(), {R, d}, torch::TensorOptions().dtype(torch::kFloat32)).clone();
  auto en = torch::from_blob(ended.data(), {R}, lopt).clone();
  return {toks.narrow(1, 0, std::max<int64_t>(tw, 1)), ncv, xo, hn_t, en,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double> batch_block_steps(
    torch::Tensor x_in, const torch::Tensor& embed, double embed_scale, const torch::Tensor& pe, int64_t max_positions,
    const std::vector<StepLayer>& layers, const torch::Tensor& self_kv, const torch::Tensor& mem_kv,
    c10::optional<torch::Tensor> mem_mask, int64_t g, int64_t t, torch::Tensor lengths, const torch::Tensor& nw,
    const torch::Tensor& nb, double eps, const Lin& proj, const Lin* fc1, const Lin* fc2, const Lin& draft_proj,
    c10::optional<torch::Tensor> draft_ids, int64_t eos, torch::Tensor room_in, int64_t max_steps, int64_t group,
    int64_t width, const ChainProp* chain, int64_t top_n, double dist_eps, bool to_end) {
  const auto t_start = std::chrono::steady_clock::now();
  EncDecLoop mdl(embed, embed_scale, pe, max_positions, layers, self_kv, mem_kv, mem_mask, g, nw, nb, eps, proj, eos);
  mdl.set_rule(top_n, dist_eps);
  torch::Tensor dids;
  if (draft_ids.has_value()) dids = draft_ids->to(torch::kLong).contiguous();
  TORCH_CHECK(chain != nullptr || (fc1 != nullptr && fc2 != nullptr), "blockwise steps: no proposal heads given");
  mdl.fc1 = fc1;
  mdl.fc2 = fc2;
  mdl.chain = chain;
  mdl.draft = &draft_proj;
  mdl.dp = dids.defined() ? dids.data_ptr<int64_t>() : nullptr;
  return batch_block_loop(mdl, x_in, t, lengths, room_in, max_steps, group, width, t_start, to_end);
}

// ==== decoder-only (Llama / Qwen2 / Mistral-style) models: model/lm.py LMModel ====
// The layer stack of one decode step on raw buffers, as decode_raw is for the encoder-decoder stack: RMSNorm,
// q/k/v (one packed linear, optional biases), rotary positions (rotate-half layout, per-row positions = slot -
// lpad), grouped-query attention over the row's cache slots lpad..slot (each query's arithmetic its own), output projection,
// SwiGLU (gate and up in one packed linear, then down). Every row is computed by the same code whatever the batch
// or the number of tokens fed, so a token's decoder output is bit-identical alone (greedy) or inside a block
// (blockwise verification). Results differ from the torch path (LMModel._run) by rounding only.

// y = weight * (x * rsqrt(mean(x^2) + eps)) per row (statistics in double, summed in a fixed order)
static void rms_rows(const float* x, float* y, int64_t M, int64_t D, const float* w, float eps) {
  thread_local std::vector<double> tmp;
  if ((int64_t)tmp.size() < D) tmp.resize(D);
  double* t = tmp.data();
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    for (int64_t i = 0; i < D; i++) t[i] = (double)xr[i] * (double)xr[i];
    const double ms = sum8(t, D) / (double)D;
    const float inv = (float)(1.0 / std::sqrt(ms + (double)eps));
    for (int64_t i = 0; i < D; i++) yr[i] = w[i] * (xr[i] * inv);
  }
}

static inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// act[i] = silu(g[i]) * u[i] (SwiGLU): the scalar path's operations (v / (1 + exp(-v)), then times u) with exp
// vectorised (vexp, ~1 ulp; the tail past whole vectors: std::exp): the same per element whatever the row or the
// number of rows, so rows stay exact. act may be g itself. A scalar std::exp per element made SwiGLU's activation
// most of a decoder-only step's "norms/residuals" time at demo size.
static inline void silu_gate(const float* g, const float* u, float* act, int64_t f) {
  const float one = 1.0f;
  const vf ones = vbcast(&one);
  int64_t i = 0;
  for (; i + L <= f; i += L) {
    const vf v = vload(g + i);
    vstore(act + i, vmul(vdiv(v, vadd(ones, vexp(vsub(vzero(), v)))), vload(u + i)));
  }
  for (; i < f; i++) act[i] = silu(g[i]) * u[i];
}

// x[i] += silu(t[i]) over one row of n (a residual head layer), exp vectorised as in silu_gate
static inline void silu_add(const float* t, float* x, int64_t n) {
  const float one = 1.0f;
  const vf ones = vbcast(&one);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const vf v = vload(t + i);
    vstore(x + i, vadd(vload(x + i), vdiv(v, vadd(ones, vexp(vsub(vzero(), v))))));
  }
  for (; i < n; i++) x[i] += silu(t[i]);
}

// One decoder-only layer's decode-step weights (model/lm.py Layer).
struct LMLayer {
  int64_t n_heads, n_kv, dh;
  double eps;
  torch::Tensor n1w, n2w;
  Lin qkv, o, gate_up, down;
  LMLayer(int64_t h, int64_t g, int64_t dh_, double e, torch::Tensor a, Lin l1, Lin l2, torch::Tensor b, Lin l3,
          Lin l4)
      : n_heads(h), n_kv(g), dh(dh_), eps(e), n1w(a.contiguous()), n2w(b.contiguous()), qkv(l1), o(l2), gate_up(l3),
        down(l4) {
    TORCH_CHECK(qkv.N == (h + 2 * g) * dh && o.K == h * dh && gate_up.N == 2 * down.K, "LMLayer: shapes disagree");
  }
};

// The whole step's weights: layers, token embedding, final RMSNorm, the vocabulary projection (head 1).
struct LMNet {
  std::vector<LMLayer> layers;
  torch::Tensor embed, nw;
  double eps;
  Lin proj;
  int64_t d;
  LMNet(std::vector<LMLayer> l, torch::Tensor e, torch::Tensor w, double ep, Lin p)
      : layers(std::move(l)), embed(e.contiguous()), nw(w.contiguous()), eps(ep), proj(p), d(e.size(1)) {
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && nw.scalar_type() == torch::kFloat32,
                "LMNet: float32 embedding and norm");
  }
};

// The proposal path for heads 1..n_heads: kind 0 = BPD heads (lins = {fc1, fc2 rows of those heads}: state_i =
// h + fc2(relu(fc1(h)))[i], then the final norm), kind 1 = Medusa heads (lins[i * n_layers + l]: x = norm(h),
// x += silu(W_il x + b_il) per layer); then `proj` (the draft vocabulary's rows where one is set, ids mapped back).
struct LMProp {
  int64_t kind, n_heads, n_layers;
  std::vector<Lin> lins;
  Lin proj;
  torch::Tensor draft;
  LMProp(int64_t k, int64_t nh, int64_t nl, std::vector<Lin> l, Lin p, c10::optional<torch::Tensor> ids)
      : kind(k), n_heads(nh), n_layers(nl), lins(std::move(l)), proj(p) {
    if (ids.has_value()) draft = ids->to(torch::kLong).contiguous();
    TORCH_CHECK(kind == 0 ? lins.size() == 2 : (int64_t)lins.size() == nh * nl, "LMProp: wrong number of linears");
  }
};

// KV cache [layers,2,R,G,cap,Dh] (model/lm.py LMState), each row's pad slots lpad [R], rotary tables [cap, Dh]
struct LMCache {
  float* kv;
  int64_t ks[6], kn[6], cap, rope_n, dh;
  mutable std::vector<int64_t> lpad;            // (move_row rearranges it with the rows)
  torch::Tensor cos_keep, sin_keep;
  const float* cos;
  const float* sin;
  LMCache(const torch::Tensor& self_kv, const torch::Tensor& lp, const torch::Tensor& cos_t, const torch::Tensor& sin_t) {
    TORCH_CHECK(self_kv.scalar_type() == torch::kFloat32, "decode: float32 caches only");
    for (int i = 0; i < 6; i++) {
      ks[i] = self_kv.stride(i);
      kn[i] = self_kv.size(i);
    }
    TORCH_CHECK(ks[5] == 1, "decode: caches must be contiguous in the head dimension");
    kv = self_kv.data_ptr<float>();
    cap = self_kv.size(4);
    dh = self_kv.size(5);
    auto l = lp.to(torch::kLong).contiguous();
    TORCH_CHECK(l.numel() == self_kv.size(2), "decode: lpad must be [R]");
    lpad.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
    cos_keep = cos_t.to(torch::kFloat32).contiguous();
    sin_keep = sin_t.to(torch::kFloat32).contiguous();
    TORCH_CHECK(cos_keep.size(-1) == dh && sin_keep.sizes() == cos_keep.sizes(), "decode: rotary tables [n, Dh]");
    rope_n = cos_keep.size(0);
    cos = cos_keep.data_ptr<float>();
    sin = sin_keep.data_ptr<float>();
  }
  // row dst = row src: its first `filled` slots and its left padding
  void move_row(int64_t dst, int64_t src, int64_t filled) const {
    move_cache_row(kv, ks, kn, dst, src, filled);
    lpad[dst] = lpad[src];
  }
};

// x*cos + rotate_half(x)*sin for n_h heads of dh at one position (the torch path's three roundings)
static inline void rope(float* x, int64_t n_h, int64_t dh, const float* c, const float* s) {
  const int64_t half = dh / 2;
  thread_local std::vector<float> tmp;
  float* t = grow(tmp, dh);
  for (int64_t hh = 0; hh < n_h; hh++) {
    float* v = x + hh * dh;
    for (int64_t i = 0; i < dh; i++) {
      const float r = i < half ? -v[i + half] : v[i - half];
      const float a = v[i] * c[i];
      const float b = r * s[i];
      t[i] = a + b;
    }
    std::memcpy(v, t, dh * sizeof(float));
  }
}

// x [M][d] (embedded tokens, in place -> output before the final norm); row m is cache row m / n at slot[m]. A query
// at slot p of row r sees slots lpad[r]..p (a pad slot, in a prefill, sees itself only: its output is never read).
static void lm_decode_raw(float* x, int64_t M, int64_t n, const int64_t* slot, const LMNet& net, const LMCache& c) {
  Work& ws = work();
  const int64_t d = net.d;
  int64_t wide = 0, hd = 0, max_slot = 0;
  for (const auto& w : net.layers) {
    wide = std::max(wide, std::max(w.qkv.N, w.gate_up.N));
    hd = std::max(hd, w.n_heads * w.dh);
  }
  for (int64_t m = 0; m < M; m++) max_slot = std::max(max_slot, slot[m]);
  TORCH_CHECK(max_slot < c.cap, "KV cache capacity ", c.cap, " exceeded (needs ", max_slot + 1, ")");
  float* y = grow(ws.y, M * d);
  float* big = grow(ws.big, M * wide);
  float* a = grow(ws.a, M * std::max(hd, d));
  float* o = grow(ws.o, M * d);
  const int64_t* ks = c.ks;
  Tick tk;
  for (size_t li = 0; li < net.layers.size(); li++) {
    const LMLayer& w = net.layers[li];
    const int64_t h = w.n_heads, g = w.n_kv, dh = w.dh, qn = w.qkv.N, rep = h / g;
    TORCH_CHECK(dh == c.dh, "decode: head size disagrees with the cache");
    const float scale = (float)(1.0 / std::sqrt((double)dh));
    rms_rows(x, y, M, d, w.n1w.data_ptr<float>(), (float)w.eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.qkv, y, big, M);                                               // [M][q H*Dh | k G*Dh | v G*Dh]
    tk.to(P_DEC_LIN);
    float* kl = c.kv + li * ks[0];
    for (int64_t m = 0; m < M; m++) {
      const int64_t row = m / n;
      const int64_t pos = std::min(std::max<int64_t>(slot[m] - c.lpad[row], 0), c.rope_n - 1);
      float* q = big + m * qn;
      rope(q, h + g, dh, c.cos + pos * dh, c.sin + pos * dh);                 // q and k heads
      for (int64_t gg = 0; gg < g; gg++) {
        std::memcpy(kl + row * ks[2] + gg * ks[3] + slot[m] * ks[4], q + (h + gg) * dh, dh * sizeof(float));
        std::memcpy(kl + ks[1] + row * ks[2] + gg * ks[3] + slot[m] * ks[4], q + (h + g + gg) * dh, dh * sizeof(float));
      }
    }
    const int64_t kmax = max_slot + 1, R = M / n;
    // one task per cache row and KV head: its n queries x `rep` query heads attend together, in runs that share
    // their first key (a prefill's pad slots each see only themselves)
    at::parallel_for(0, R * g, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * rep * kmax * dh)),
                     [&](int64_t lo, int64_t hi) {
      const AttnScratch buf = attn_scratch(n * rep, kmax);
      float* scp = buf.sc;
      const float** qs = buf.q;
      float** os = buf.out;
      int64_t* lens = buf.len;
      for (int64_t i = lo; i < hi; i++) {
        const int64_t row = i / g, gg = i % g;
        int64_t cnt = 0, run_start = -1;
        auto flush = [&]() {
          if (cnt == 0) return;
          const float* base = kl + row * ks[2] + gg * ks[3] + run_start * ks[4];
          attend(cnt, qs, lens, base, base + ks[1], ks[4], nullptr, scale, os, dh, scp);
          cnt = 0;
        };
        for (int64_t j = 0; j < n; j++) {
          const int64_t m = row * n + j;
          const int64_t start = slot[m] >= c.lpad[row] ? c.lpad[row] : slot[m];
          if (start != run_start) { flush(); run_start = start; }
          for (int64_t hh = gg * rep; hh < (gg + 1) * rep; hh++) {
            qs[cnt] = big + m * qn + hh * dh;
            os[cnt] = a + m * h * dh + hh * dh;
            lens[cnt] = slot[m] + 1 - start;
            cnt++;
          }
        }
        flush();
      }
    });
    tk.to(P_DEC_ATT);
    lin_rows(w.o, a, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    rms_rows(x, y, M, d, w.n2w.data_ptr<float>(), (float)w.eps);
    tk.to(P_DEC_OTHER);
    lin_rows(w.gate_up, y, big, M);                                           // [M][gate F | up F]
    tk.to(P_DEC_LIN);
    const int64_t f = w.down.K;
    for (int64_t m = 0; m < M; m++) {
      float* gu = big + m * 2 * f;
      float* act = big + m * f;   // in place: row m's outputs overwrite its own or earlier rows' consumed inputs
      silu_gate(gu, gu + f, act, f);
    }
    tk.to(P_DEC_OTHER);
    lin_rows(w.down, big, o, M);
    tk.to(P_DEC_LIN);
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];
    tk.to(P_DEC_OTHER);
  }
}

static void lm_head1_ids(const float* h, int64_t M, const LMNet& net, int64_t* out, bool full = false) {
  Work& ws = work();
  const int64_t d = net.d;
  float* y = grow(ws.n1, M * d);
  rms_rows(h, y, M, d, net.nw.data_ptr<float>(), (float)net.eps);
  project_ids(y, M, net.proj, out, full, ws.logits);
}

// heads 1..n_heads at M positions h [M][d] -> ids [M][n_heads]
static void lm_propose_raw(const float* h, int64_t M, const LMNet& net, const LMProp& p, int64_t n_heads,
                           int64_t* out) {
  TORCH_CHECK(n_heads == p.n_heads, "propose: ", n_heads, " heads asked of a proposal path for ", p.n_heads);
  Work& ws = work();
  const int64_t d = net.d;
  const float* nw = net.nw.data_ptr<float>();
  const float eps = (float)net.eps;
  Tick tk;
  float* st = grow(ws.st, M * n_heads * d);
  float* y = grow(ws.sy, M * n_heads * d);
  if (p.kind == 0) {
    const Lin& fc1 = p.lins[0];
    const Lin& fc2 = p.lins[1];
    float* hid = grow(ws.hid, M * fc1.N);
    lin_rows(fc1, h, hid, M);
    for (int64_t i = 0; i < M * fc1.N; i++) hid[i] = std::max(hid[i], 0.0f);
    lin_rows(fc2, hid, st, M);                                               // [M][n_heads][D]
    for (int64_t m = 0; m < M; m++)
      for (int64_t i = 0; i < n_heads * d; i++) st[m * n_heads * d + i] += h[m * d + i % d];
    rms_rows(st, y, M * n_heads, d, nw, eps);
  } else {
    float* nrm = grow(ws.hid, M * d + M * d);
    float* xi = nrm + M * d;
    rms_rows(h, nrm, M, d, nw, eps);
    for (int64_t hh = 0; hh < n_heads; hh++) {
      std::memcpy(xi, nrm, M * d * sizeof(float));
      for (int64_t l = 0; l < p.n_layers; l++) {
        float* t = st;                                                       // scratch [M][d]
        lin_rows(p.lins[hh * p.n_layers + l], xi, t, M);
        for (int64_t m = 0; m < M; m++) silu_add(t + m * d, xi + m * d, d);   // per row: the same split for every row
      }
      for (int64_t m = 0; m < M; m++) std::memcpy(y + (m * n_heads + hh) * d, xi + m * d, d * sizeof(float));
    }
  }
  tk.to(P_HEADS_FFN);
  int64_t* ids = grow(ws.pids, M * n_heads);
  project_ids(y, M * n_heads, p.proj, ids, false, ws.plog);
  const int64_t* dp = p.draft.defined() ? p.draft.data_ptr<int64_t>() : nullptr;
  for (int64_t m = 0; m < M * n_heads; m++) out[m] = dp ? dp[ids[m]] : ids[m];
  tk.to(P_PROPOSE_PROJ);
}

struct LMLoop : LoopModel {
  const LMNet& net;
  const LMCache c;
  const LMProp* prop = nullptr;
  LMLoop(const LMNet& n, const torch::Tensor& self_kv, const torch::Tensor& lpad, const torch::Tensor& cos,
         const torch::Tensor& sin, const torch::Tensor& stop_ids)
      : net(n), c(self_kv, lpad, cos, sin) {
    d = n.d;
    stops = stop_list(stop_ids);
  }
  void embed(const int64_t* tok, const int64_t*, int64_t M, float* x) const override {
    const float* e = net.embed.data_ptr<float>();
    const int64_t V = net.embed.size(0);
    for (int64_t m = 0; m < M; m++) {
      TORCH_CHECK(tok[m] >= 0 && tok[m] < V, "decode: token id ", tok[m], " outside the vocabulary");
      std::memcpy(x + m * d, e + tok[m] * d, d * sizeof(float));
    }
  }
  void layers(float* x, int64_t M, int64_t n, const int64_t* slot) const override {
    lm_decode_raw(x, M, n, slot, net, c);
  }
  void head1(const float* h, int64_t M, int64_t* out) const override { lm_head1_ids(h, M, net, out, top_n > 0); }
  int64_t vocab() const override { return net.proj.N; }
  bool move_row(int64_t dst, int64_t src, int64_t filled) const override {
    c.move_row(dst, src, filled);
    return true;
  }
  void propose(const float* h, int64_t M, int64_t n_heads, const int64_t*, int64_t* out) const override {
    TORCH_CHECK(prop != nullptr, "propose: no proposal path given");
    lm_propose_raw(h, M, net, *prop, n_heads, out);
  }
};

// tokens [R,n] at cache slots [R,n] (each row's own) -> decoder output [R,n,D] before the final norm (LMModel.decode
// and its prefill on the native path)
torch::Tensor lm_decode_layers(const torch::Tensor& tokens, const LMNet& net, const torch::Tensor& self_kv,
                               const torch::Tensor& lpad, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& slots) {
  TORCH_CHECK(tokens.dim() == 2 && slots.sizes() == tokens.sizes(), "lm_decode_layers: tokens and slots [R,n]");
  const int64_t r = tokens.size(0), n = tokens.size(1), M = r * n;
  auto tk = tokens.to(torch::kLong).contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  LMLoop mdl(net, self_kv, lpad, cos, sin, torch::empty({0}, torch::kLong));
  auto x = torch::empty({r, n, net.d}, torch::TensorOptions().dtype(torch::kFloat32));
  mdl.embed(tk.data_ptr<int64_t>(), nullptr, M, x.data_ptr<float>());
  if (M > 0) mdl.layers(x.data_ptr<float>(), M, n, sl.data_ptr<int64_t>());
  return x;
}

torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& w, double eps) {
  auto x = h.to(torch::kFloat32).contiguous();
  auto y = torch::empty_like(x);
  const int64_t d = x.size(-1);
  auto wc = w.contiguous();
  rms_rows(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() / d, d, wc.data_ptr<float>(), (float)eps);
  return y;
}

// head 1's next token: argmax of proj(rms_norm(h)), h [...,D] -> ids [...]
torch::Tensor lm_head1_argmax(const torch::Tensor& h, const LMNet& net) {
  auto x = h.to(torch::kFloat32).contiguous();
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto ids = torch::empty(shape, x.options().dtype(torch::kLong));
  lm_head1_ids(x.data_ptr<float>(), x.numel() / net.d, net, ids.data_ptr<int64_t>());
  return ids;
}

// heads' proposals h [...,D] -> ids [..., n_heads]
torch::Tensor lm_propose(const torch::Tensor& h, const LMNet& net, const LMProp& p) {
  auto x = h.to(torch::kFloat32).contiguous();
  auto shape = x.sizes().vec();
  shape.back() = p.n_heads;
  auto ids = torch::empty(shape, x.options().dtype(torch::kLong));
  lm_propose_raw(x.data_ptr<float>(), x.numel() / net.d, net, p, p.n_heads, ids.data_ptr<int64_t>());
  return ids;
}

// greedy_steps for a decoder-only model: a row ends on any of `stops`
std::tuple<torch::Tensor, torch::Tensor, double> lm_greedy_steps(
    torch::Tensor tok, const LMNet& net, const torch::Tensor& self_kv, const torch::Tensor& lpad,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t t, c10::optional<torch::Tensor> lengths,
    const torch::Tensor& stops, torch::Tensor room, int64_t max_steps, bool to_end) {
  const auto t_start = std::chrono::steady_clock::now();
  const LMLoop mdl(net, self_kv, lpad, cos, sin, stops);
  return greedy_loop(mdl, tok, first_slots(tok.size(0), t, lengths), room, max_steps, t_start, to_end);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double> lm_block_steps(
    torch::Tensor x_in, const LMNet& net, const LMProp& prop, const torch::Tensor& self_kv, const torch::Tensor& lpad,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t t, const torch::Tensor& stops, int64_t room,
    int64_t max_steps, int64_t group, int64_t width, int64_t top_n, double dist_eps) {
  const auto t_start = std::chrono::steady_clock::now();
  LMLoop mdl(net, self_kv, lpad, cos, sin, stops);
  mdl.prop = &prop;
  mdl.set_rule(top_n, dist_eps);
  return block_loop(mdl, x_in, t, room, max_steps, group, width, t_start);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double> lm_batch_block_steps(
    torch::Tensor x_in, const LMNet& net, const LMProp& prop, const torch::Tensor& self_kv, const torch::Tensor& lpad,
    const torch::Tensor& cos, const torch::Tensor& sin, int64_t t, torch::Tensor lengths, const torch::Tensor& stops,
    torch::Tensor room, int64_t max_steps, int64_t group, int64_t width, int64_t top_n, double dist_eps,
    bool to_end) {
  const auto t_start = std::chrono::steady_clock::now();
  LMLoop mdl(net, self_kv, lpad, cos, sin, stops);
  mdl.prop = &prop;
  mdl.set_rule(top_n, dist_eps);
  return batch_block_loop(mdl, x_in, t, lengths, room, max_steps, group, width, t_start, to_end);
}

// per-phase seconds and steps since the last reset (phases: embed, decoder linears, decoder attention, decoder
// other (norms, residuals, SwiGLU's activation), head 1 (verify / greedy argmax), heads' FFN, proposal projection, other)
std::tuple<std::vector<double>, int64_t> profile(bool enable, bool reset) {
  std::vector<double> out(g_prof_s, g_prof_s + P_N);
  int64_t steps = g_prof_steps;
  if (reset) { for (auto& v : g_prof_s) v = 0.0; g_prof_steps = 0; }
  g_prof = enable;
  return {out, steps};
}

std::string isa() { return BPD_NATIVE_ISA; }
bool bf16_dot() { return BPD_BF16_DOT; }
bool i8_dot() { return BPD_I8_DOT; }
// whether this build has AMX kernels and the process may use the tiles (mode BF16A; I8D from AMX_MIN_ROWS rows)
bool amx() {
#if BPD_AMX
  return amx_permitted();
#else
  return false;
#endif
}
void set_amx(bool on) {
#if BPD_AMX
  g_amx_off = !on;
#else
  (void)on;
#endif
}

// model/cache.py DecoderState reorder's common case: rows dst[i] of x (along dim) = rows src[i], the first `limit`
// entries along limit_dim only (limit < 0: all), in place; no dst row is a src row. A few ATen calls per row from
// here cost microseconds where the same ops from Python (plus the index bookkeeping) cost ~0.4 ms per reorder.
void copy_rows(torch::Tensor x, int64_t dim, const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
               int64_t limit_dim, int64_t limit) {
  TORCH_CHECK(dst.size() == src.size(), "copy_rows: dst and src differ in length");
  const int64_t ld = limit_dim - (limit_dim > dim ? 1 : 0);
  for (size_t i = 0; i < dst.size(); i++) {
    auto a = x.select(dim, dst[i]);
    auto b = x.select(dim, src[i]);
    if (limit >= 0) {
      a = a.narrow(ld, 0, limit);
      b = b.narrow(ld, 0, limit);
    }
    a.copy_(b);
  }
}

// A module tree's parameter states, the key under which packed decode weights stay valid (engine/packed.py
// weights_key): per parameter in registration order (the same walk as nn.Module.named_parameters without its
// dedup) its data pointer, in-place version and whether it is on the CPU, as bytes. The Python walk over a
// demo-size model's 40 modules costs ~0.25 ms of a ~4 ms batch-1 call once a decode has evicted the interpreter's
// working set; here it is a few microseconds. Anything unexpected (a parameter that is not a tensor, a tensor
// without storage) raises, and the caller walks in Python.
static void param_states_walk(PyObject* mod, std::vector<int64_t>& out, int depth) {
  TORCH_CHECK(depth < 1000, "module tree too deep");
  static PyObject* s_params = PyUnicode_InternFromString("_parameters");
  static PyObject* s_mods = PyUnicode_InternFromString("_modules");
  PyObject* params = PyObject_GetAttr(mod, s_params);
  if (params == nullptr) throw pybind11::error_already_set();
  pybind11::object pguard = pybind11::reinterpret_steal<pybind11::object>(params);
  TORCH_CHECK(PyDict_Check(params), "_parameters is not a dict");
  PyObject *key, *val;
  Py_ssize_t pos = 0;
  while (PyDict_Next(params, &pos, &key, &val)) {
    if (val == Py_None) continue;
    TORCH_CHECK(THPVariable_Check(val), "a parameter is not a tensor");
    const at::Tensor& t = THPVariable_Unpack(val);
    out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    out.push_back(t._version());
    out.push_back(t.is_cpu() ? 1 : 0);
  }
  PyObject* mods = PyObject_GetAttr(mod, s_mods);
  if (mods == nullptr) throw pybind11::error_already_set();
  pybind11::object mguard = pybind11::reinterpret_steal<pybind11::object>(mods);
  TORCH_CHECK(PyDict_Check(mods), "_modules is not a dict");
  pos = 0;
  while (PyDict_Next(mods, &pos, &key, &val))
    if (val != Py_None) param_states_walk(val, out, depth + 1);
}

pybind11::bytes param_states(pybind11::handle module) {
  std::vector<int64_t> out;
  out.reserve(512);
  param_states_walk(module.ptr(), out, 0);
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

// How many threads at::parallel_for really runs the kernels on: it is header code that is serial unless this file
// is built with OpenMP (fastlinear.py passes -fopenmp; without it "2 threads" ran every kernel on one).
int64_t parallel_threads(int64_t chunks) {
  std::vector<int> seen(256, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    const int t = at::get_thread_num();
    volatile double spin = 0;                       // long enough that one thread cannot take every chunk
    for (int64_t i = lo; i < hi; i++)
      for (int j = 0; j < 200000; j++) spin = spin + 1.0;
    if (t >= 0 && t < 256) seen[t] = 1;
  });
  int64_t n = 0;
  for (int v : seen) n += v;
  return n;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "distinct threads that ran the chunks of one at::parallel_for");
  m.def("pack", &pack, "pack a [N,K] float32 weight for linear()");
  m.def("linear", &linear, "y = x . W^T (+ b) with a packed W");
  m.def("isa", &isa);
  m.def("i8_dot", &i8_dot, "whether mode 4 (int8 activations x int8 weights: vpdpbusd, or vpmaddwd on AVX2) is built");
  m.def("i8_avx2", []() { return (bool)BPD_I8_AVX2; }, "whether mode 4 runs on the AVX2 (vpmaddwd) kernels");
  m.def("amx", &amx, "whether AMX tiles run mode 5 (bf16) and int8 from 4 rows (this build, and the process may use them)");
  m.def("set_amx", &set_amx, "int8: whether AMX tiles may run it (bits unchanged either way)");
  m.def("bf16_dot", &bf16_dot, "whether mode 3 (bf16 activations x bf16 weights, vdpbf16ps) is built");
  pybind11::class_<Lin>(m, "Lin")
      .def(pybind11::init<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t,
                          int64_t>())
      .def("__call__", &Lin::operator())
      .def("add_screen", &Lin::add_screen, "screen this fp32 projection's argmax with an int8 copy of w [N, K]")
      .def("screened", [](const Lin& l) { return (bool)l.screen; });
  m.def("layer_norm", &layer_norm);
  m.def("norm_project_argmax", &norm_project_argmax);
  pybind11::class_<StepLayer>(m, "StepLayer")
      .def(pybind11::init<int64_t, double, torch::Tensor, torch::Tensor, Lin, Lin, torch::Tensor, torch::Tensor, Lin, Lin,
                          torch::Tensor, torch::Tensor, Lin, Lin>());
  m.def("decode_layers", &decode_layers);
  pybind11::class_<EncLayer>(m, "EncLayer")
      .def(pybind11::init<int64_t, double, torch::Tensor, torch::Tensor, Lin, Lin, torch::Tensor, torch::Tensor, Lin,
                          Lin>());
  m.def("encode_ids", &encode_ids);
  m.def("memory_kv", &memory_kv);
  m.def("propose", &propose);
  pybind11::class_<ChainProp>(m, "ChainProp")
      .def(pybind11::init<std::vector<Lin>, std::vector<Lin>, std::vector<Lin>, torch::Tensor, double>());
  m.def("propose_chain", &propose_chain);
  m.def("greedy_steps", &greedy_steps);
  m.def("block_steps", &block_steps);
  m.def("batch_block_steps", &batch_block_steps);
  m.def("profile", &profile);
  m.def("copy_rows", &copy_rows, "rows dst of x = rows src (cache reorders)");
  m.def("param_states", &param_states, "a module tree's parameter (data pointer, version, on CPU) as bytes");
  // decoder-only models (model/lm.py)
  pybind11::class_<LMLayer>(m, "LMLayer")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, Lin, Lin, torch::Tensor, Lin, Lin>());
  pybind11::class_<LMNet>(m, "LMNet")
      .def(pybind11::init<std::vector<LMLayer>, torch::Tensor, torch::Tensor, double, Lin>());
  pybind11::class_<LMProp>(m, "LMProp")
      .def(pybind11::init<int64_t, int64_t, int64_t, std::vector<Lin>, Lin, c10::optional<torch::Tensor>>());
  m.def("lm_decode_layers", &lm_decode_layers);
  m.def("rms_norm", &rms_norm);
  m.def("lm_head1_argmax", &lm_head1_argmax);
  m.def("lm_propose", &lm_propose);
  m.def("lm_greedy_steps", &lm_greedy_steps);
  m.def("lm_block_steps", &lm_block_steps);
  m.def("lm_batch_block_steps", &lm_batch_block_steps);
}
