// The Q4Q kernels: 4-bit weights (a scale d and an offset m per 32 weights of a row, both half precision: a GGUF's
// Q4_0 / Q4_1 blocks as the file holds them, or weights quantised so at load) times activations quantised to int8
// per block of 32 (a scale per block, as llama.cpp's Q8_1 activations for its Q4_1 weights). Per block of 32 k and
// output n: sumi = sum over k of code * q, an exact integer (vpdpbusd on AVX512_VNNI, vpmaddubsw + vpmaddwd on
// AVX2: the same integer), then acc = fma(sumi, d * dx, acc), acc = fma(m, sx, acc) with sx = dx * sum of the
// block's q: the same float steps per output whatever the rows in the call, their order or the thread count, and
// on every x86 CPU (AVX2 and AVX-512 builds give the same bits).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "vec.h"

namespace {

// One activation row's block of 32: the codes q = round(x / dx) in [-127, 127], dx = max |x| / 127 and
// sx = dx * (sum of q) (run_mode's Q4Q step writes them, the row alone decides them)
struct Q8Block {
  int8_t q[32];
  float d, s;
};
static_assert(sizeof(Q8Block) == 40, "Q8Block: 40 bytes");

// Packed layout (engine/q4blocks.py pack_q4q): per block of 64 weight rows, 4 sub-blocks of 16 rows, each [K/32]
// groups of Q4QG bytes: d[16] and m[16] (half precision), then 4 chunks of 64 bytes, chunk t holding row n's codes
// of k = 4t..4t+3 in bytes 4n..4n+3 (low nibbles) and of k = 16+4t..16+4t+3 (high nibbles). Layout F (mode
// Q4QF): d and m as float32, 384 bytes a group. Layout F = 2 (mode Q4QK, a GGUF's Q4_K as the file holds it): per 8
// groups (256 k) d256[16] and dmin256[16] (half precision), then per group sc[16] and mn[16] (6-bit integers in
// bytes) and the codes: d = d256 * sc and m = -(dmin256 * mn), both exact in float32 (2368 bytes per 8 groups).
constexpr int64_t Q4QG = 320, Q4QG_F = 384, Q4QK_SB = 2368;
template <int F> constexpr int64_t q4q_group() { return F == 0 ? Q4QG : F == 1 ? Q4QG_F : Q4QK_SB / 8; }   // (mean)
// group g's bytes: its codes (256 bytes) and, layouts 0 / 1, its d and m
template <int F> static inline const uint8_t* q4q_at(const uint8_t* w, int64_t g) {
  return F == 2 ? w + (g >> 3) * Q4QK_SB + 64 + (g & 7) * 288 : w + g * q4q_group<F>();
}
template <int F> static inline const uint8_t* q4q_codes(const uint8_t* w, int64_t g) {
  return q4q_at<F>(w, g) + (F == 0 ? 64 : F == 1 ? 128 : 32);
}
// the d and m of rows 8h..8h+7 (AVX2) of group g
template <int F> static inline void q4q_dm8(const uint8_t* w, int64_t g, int h, __m256& dw, __m256& mw) {
  const uint8_t* p = q4q_at<F>(w, g);
  if (F == 0) {
    dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
    mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * h)));
  } else if (F == 1) {
    dw = _mm256_loadu_ps((const float*)(p + 32 * h));
    mw = _mm256_loadu_ps((const float*)(p + 64 + 32 * h));
  } else {
    const uint8_t* sb = w + (g >> 3) * Q4QK_SB;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 16 + 8 * h))));
    dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sb + 16 * h))), sc);
    mw = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sb + 32 + 16 * h))), mn),
                       _mm256_set1_ps(-0.0f));
  }
}

// quantise rows x [M][K] (K a multiple of 32) into Q8Blocks [M][K/32]
static void q8_rows(const float* x, int64_t M, int64_t K, Q8Block* out) {
  const int64_t G = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      const float* xb = x + m * K + g * 32;
      Q8Block& b = out[m * G + g];
      __m256 v[4];
      for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
      __m256 am = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 q4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
      q4 = _mm_max_ps(q4, _mm_movehl_ps(q4, q4));
      q4 = _mm_max_ss(q4, _mm_movehdup_ps(q4));
      const float amax = _mm_cvtss_f32(q4);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;   // (NaN: max ignores it; inf: zero codes)
      b.d = amax / 127.0f;
      const __m256 iv = _mm256_set1_ps(std::isfinite(inv) ? inv : 0.0f);
      int32_t sum = 0;
      for (int i = 0; i < 4; i++) {
        __m256 q = _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);         // (NaN lanes: max gives -127)
        alignas(32) int32_t qi[8];
        _mm256_store_si256((__m256i*)qi, _mm256_cvttps_epi32(q));
        for (int e = 0; e < 8; e++) { b.q[8 * i + e] = (int8_t)qi[e]; sum += qi[e]; }
      }
      b.s = b.d * (float)sum;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BPD_Q4Q_VNNI 1
// R rows ([R][G] blocks) times one sub-block (16 weight rows): out[i][0..16) at out + i * NB; pf (or null): bytes
// to fetch into L2 meanwhile, a group's worth per group. C integer chains per row (the low and the high nibbles
// apart where registers allow: one row's 8 dependent vpdpbusd per block would wait on their latency), added at the
// block's end (exact). With one or two rows (H) the high nibbles are multiplied in place (v & 0xf0: 16 x the code,
// no shift per 64 bytes) and their chain divided by 16 at the block's end (an exact shift: every product is a
// multiple of 16).
template <int R, int F>
static inline void q4q_rows(const Q8Block* x, int64_t G, const uint8_t* w, float* out, const char* pf) {
  constexpr int C = R <= 4 ? 2 : 1;
  constexpr bool H = C == 2 && R <= 2;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < G; g++) {
    if (pf) for (int64_t b = 0; b < q4q_group<F>(); b += 64) _mm_prefetch(pf + g * q4q_group<F>() + b, _MM_HINT_T1);
    __m512i si[R][C];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 2
      for (int c = 0; c < C; c++) si[i][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
      const __m512i v = _mm512_loadu_si512((const void*)(q4q_codes<F>(w, g) + 64 * t));
      const __m512i lo = _mm512_and_si512(v, nib);
      const __m512i hi = H ? _mm512_andnot_si512(nib, v) : _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#pragma GCC unroll 8
      for (int i = 0; i < R; i++) {
        const int32_t* xq = (const int32_t*)x[i * G + g].q;
        si[i][0] = _mm512_dpbusd_epi32(si[i][0], lo, _mm512_set1_epi32(xq[t]));
        si[i][C - 1] = _mm512_dpbusd_epi32(si[i][C - 1], hi, _mm512_set1_epi32(xq[t + 4]));
      }
    }
    const uint8_t* p = q4q_at<F>(w, g);
    __m512 dw, mw;
    if (F == 0) {
      dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
    } else if (F == 1) {
      dw = _mm512_loadu_ps((const float*)p);
      mw = _mm512_loadu_ps((const float*)(p + 64));
    } else {   // rows 0-7 and 8-15 as the AVX2 form reads them
      __m256 d0, m0, d1, m1;
      q4q_dm8<F>(w, g, 0, d0, m0);
      q4q_dm8<F>(w, g, 1, d1, m1);
      dw = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
      mw = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      const __m512i sum =
          C == 1 ? si[i][0] : _mm512_add_epi32(si[i][0], H ? _mm512_srai_epi32(si[i][C - 1], 4) : si[i][C - 1]);
      const Q8Block& b = x[i * G + g];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(b.d)), acc[i]);
      acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(b.s), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) _mm512_storeu_ps(out + i * NB, acc[i]);
}

// One sub-block at a time, the next 64-row block fetched into L2 meanwhile: from memory, sub-blocks side by side
// (4 streams for one row) and no prefetch ran slower (docs/experiments.md 8.16).
template <int R, int F>
static inline void q4q_block(const Q8Block* x, int64_t G, const uint8_t* w, float* out, const uint8_t* next) {
  const int64_t ss = G * q4q_group<F>();   // bytes per sub-block
  for (int s = 0; s < 4; s++)
    q4q_rows<R, F>(x, G, w + s * ss, out + s * 16, next ? (const char*)next + s * ss : nullptr);
}
#else
#define BPD_Q4Q_VNNI 0
// AVX2: 8 weight rows (half a sub-block) at a time, up to 4 activation rows per pass; vpmaddubsw multiplies the
// u8 codes (0..15) by the s8 activations into int16 pairs (|sum of 4| <= 7620: never saturates), vpmaddwd by ones
// adds the pairs into int32 lanes: the VNNI kernel's integer per output.
template <int R, int F>
static inline void q4q_half(const Q8Block* x, int64_t G, const uint8_t* w, int h, float* out, const char* pf) {
  constexpr int64_t GB = q4q_group<F>();
  __m256 acc[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* p = q4q_codes<F>(w, g);
    if (pf) for (int b = 0; b < GB / 2; b += 64) _mm_prefetch(pf + g * (GB / 2) + b, _MM_HINT_T1);
    __m256i si[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) si[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * t + 32 * h));
      const __m256i lo = _mm256_and_si256(v, nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#pragma GCC unroll 4
      for (int i = 0; i < R; i++) {
        const int32_t* xq = (const int32_t*)x[i * G + g].q;
        const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[t])),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[t + 4])));
        si[i] = _mm256_add_epi32(si[i], _mm256_madd_epi16(p16, ones));
      }
    }
    __m256 dw, mw;
    q4q_dm8<F>(w, g, h, dw, mw);
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
      const Q8Block& b = x[i * G + g];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[i]), _mm256_mul_ps(dw, _mm256_set1_ps(b.d)), acc[i]);
      acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(b.s), acc[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; i++) _mm256_storeu_ps(out + i * NB + 8 * h, acc[i]);
}

// next: the next packed block, fetched into L2 over the 8 passes (the hardware prefetchers follow the half passes
// poorly from memory)
template <int R, int F>
static inline void q4q_block(const Q8Block* x, int64_t G, const uint8_t* w, float* out, const uint8_t* next) {
  constexpr int64_t GB = q4q_group<F>();
  const int64_t ss = G * GB;
  for (int s = 0; s < 4; s++)
    for (int h = 0; h < 2; h++) {
      const char* pf = next ? (const char*)next + (2 * s + h) * G * (GB / 2) : nullptr;
      if (R <= 4) {
        q4q_half<R <= 4 ? R : 4, F>(x, G, w + s * ss, h, out + s * 16, pf);
      } else {   // 5-8 rows: 4, then the rest (the sub-block's bytes are in L1 for the second pass)
        q4q_half<4, F>(x, G, w + s * ss, h, out + s * 16, pf);
        q4q_half<R <= 4 ? 1 : R - 4, F>(x + 4 * G, G, w + s * ss, h, out + 4 * NB + s * 16, nullptr);
      }
    }
}
#endif

template <int F> struct Q4QKernT {
  using X = Q8Block; using WT = uint8_t;
  static constexpr int xw = 1;
  static int64_t stride(int64_t G) { return 4 * G * q4q_group<F>(); }   // bytes per block of 64 rows (G = K / 32)
  template <int R> static void blk(const X* x, int64_t G, const WT* w, float* o, const WT* nx) {
    q4q_block<R, F>(x, G, w, o, nx);
  }
  static void one(const X* x, int64_t G, const WT* w, float* o, const WT* nx) { q4q_block<1, F>(x, G, w, o, nx); }
  template <int R> static void half(const X* x, int64_t G, const WT* w, float* o, const WT* nx) {
    q4q_block<R, F>(x, G, w, o, nx);
  }
};
using Q4QKern = Q4QKernT<0>;    // mode Q4Q: half-precision d and m (Q4_0 / Q4_1)
using Q4QFKern = Q4QKernT<1>;   // mode Q4QF: float32 d and m
using Q4QKKern = Q4QKernT<2>;   // mode Q4QK: Q4_K's own scales (6-bit multiples of a half per 256)

}  // namespace
