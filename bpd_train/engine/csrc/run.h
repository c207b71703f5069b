// The kernel drivers: run() walks the packed blocks (over threads) and the activation rows (in register blocks)
// with one kernel family; run_amx() the same on AMX tiles.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "kernels_fma.h"
#include "kernels_bf16.h"
#include "kernels_int8.h"
#include "kernels_amx.h"
#include "kernels_q4.h"
#include "kernels_q4q.h"

namespace {

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
  static constexpr int xw = BPD_I8_AVX2 ? 2 : 1;         // AVX2: a quad's u8 widened to two int16 pairs
  static int64_t stride(int64_t K4) { return 4 * NB * (K4 + 1); }   // the initial accumulators, then the weights
  template <int R> static void blk(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_id<R>(x, K, w, o); }
  static void one(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_id<1>(x, K, w, o); }
  template <int R> static void half(const X* x, int64_t K, const WT* w, float* o, const WT* nx) {
    half_block_id<R>(x, K, w, o, nx);
  }
};
#endif
#if BPD_I8_AVX2
struct I16DotKern {                                     // signed int16 activations x the I8D weights (AVX2 only)
  using X = uint32_t; using WT = int8_t;
  static constexpr int xw = 2;
  static int64_t stride(int64_t K4) { return 4 * NB * (K4 + 1); }
  template <int R> static void blk(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_i16<R>(x, K, w, o); }
  static void one(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_i16<1>(x, K, w, o); }
  template <int R> static void half(const X* x, int64_t K, const WT* w, float* o, const WT*) { block_i16<R>(x, K, w, o); }
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
