// The AMX tile kernels (Sapphire Rapids and later): bf16 and int8 compute on 16-row tiles.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "kernels_bf16.h"
#include "kernels_int8.h"

namespace {

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

}  // namespace
