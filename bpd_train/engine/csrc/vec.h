// The vector type the kernels and loops compute with (vf: 16 float lanes, one zmm or two ymm) and its helpers:
// loads, broadcasts, FMA, horizontal sums, exp, abs and compares; the packing constants and weight formats (Mode).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <tuple>
#include <chrono>
#include <vector>
#include <set>
#include <algorithm>
#include <memory>
#include <cstdlib>
#include <mutex>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <atomic>
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
// Q4F: fp32 arithmetic over 4-bit codes with a scale and offset per 32 weights of a row, for weights that are
// such blocks exactly (kernels_q4.h); the fp32 kernels' bits.
// Q4Q: 4-bit codes with a half-precision scale and offset per 32 weights of a row times activations quantised to
// int8 per block of 32 (kernels_q4q.h): a GGUF's Q4_0 / Q4_1 blocks multiplied as llama.cpp's CPU backend does.
// Q4QF: the same with a float32 scale and offset per 32; Q4QK: with a GGUF's Q4_K scales as the file holds them.
enum Mode { F32 = 0, BF16 = 1, I8 = 2, BF16D = 3, I8D = 4, BF16A = 5, Q4F = 6, Q4Q = 7, Q4QF = 8, Q4QK = 9 };

// An IEEE half (torch.float16's layout): the K/V cache's element in the precisions that are not fp32 (lm.h LMCache)
struct f16 { uint16_t bits; };
#if !defined(__F16C__)
#error "bpd_train native decode kernels need F16C (every AVX2 CPU has it)"
#endif

#if defined(__AVX512F__)
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
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
// memory operand per FMA): a 4-row block then needs 16 vector loads per k instead of 4 and the FMA units wait.
static inline void keep(vf& v) { asm("" : "+v"(v)); }  // (on a local: on an array element GCC stores it)
#define BPD_NATIVE_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
// 16 lanes as two 8-lane halves: same per-lane arithmetic order as the AVX-512 build.
struct vf { __m256 lo, hi; };
static inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline vf vload(const f16* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
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

// one element of a K/V cache as float, and n floats into one (halves rounded to nearest even, as torch's .half())
static inline float sload(const float* p) { return *p; }
static inline float sload(const f16* p) { return _cvtsh_ss(p->bits); }
static inline void kv_store(float* d, const float* s, int64_t n) { std::memcpy(d, s, n * sizeof(float)); }
static inline void kv_store(f16* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; i++) d[i].bits = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
}

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
// Vectorised: a std::exp per attention slot or SwiGLU element dominated those phases.
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

}  // namespace
