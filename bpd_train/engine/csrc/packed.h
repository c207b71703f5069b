// Packed linear layers: pack() (a weight into a kernel family's format), run_mode() / linear() (x times a packed
// weight in any mode), Lin (one packed layer as an object the step functions chain) and lin_rows().
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "run.h"

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
  else if (mode == Q4F) {
    TORCH_CHECK(K % 32 == 0 && packed.numel() == (N + NB - 1) / NB * Q4Kern::stride(K), "linear: bad Q4F weight");
    run<Q4Kern>(xp, packed.data_ptr<uint8_t>(), nullptr, bp, yp, M, N, K);
  }
  else if (mode == Q4Q || mode == Q4QF || mode == Q4QK) {  // activation rows quantised per block of 32 (q8_rows)
    const int64_t G = K / 32;
    const int64_t stride =
        mode == Q4Q ? Q4QKern::stride(G) : mode == Q4QF ? Q4QFKern::stride(G) : Q4QKKern::stride(G);
    TORCH_CHECK(K % 32 == 0 && (mode != Q4QK || K % 256 == 0) && packed.numel() == (N + NB - 1) / NB * stride,
                "linear: bad Q4Q weight");
    thread_local std::vector<Q8Block> xq;
    if ((int64_t)xq.size() < M * G) xq.resize(M * G);
    q8_rows(xp, M, K, xq.data());
    if (mode == Q4Q) run<Q4QKern>(xq.data(), packed.data_ptr<uint8_t>(), nullptr, bp, yp, M, N, G);
    else if (mode == Q4QF) run<Q4QFKern>(xq.data(), packed.data_ptr<uint8_t>(), nullptr, bp, yp, M, N, G);
    else run<Q4QKKern>(xq.data(), packed.data_ptr<uint8_t>(), nullptr, bp, yp, M, N, G);
  }
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
      // even, clamp), so the same bytes: the scalar loop could cost more than the int8 dot products
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
#if BPD_I8_AVX2
    // the u8 activations widened to int16 once here, not per weight block in the kernels (vpmaddwd reads pairs)
    thread_local std::vector<uint32_t> xw;
    if ((int64_t)xw.size() < 2 * M * K4) xw.resize(2 * M * K4);
    const uint8_t* src = (const uint8_t*)xq.data();
    uint16_t* dst = (uint16_t*)xw.data();
    int64_t e = 0;
    for (; e + 16 <= 4 * M * K4; e += 16)
      _mm256_storeu_si256((__m256i*)(dst + e), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(src + e))));
    for (; e < 4 * M * K4; e++) dst[e] = src[e];
    run<I8DotKern>(xw.data(), packed.data_ptr<int8_t>(), sp, bp, yp, M, N, K4, rs.data());
#else
    run<I8DotKern>(xq.data(), packed.data_ptr<int8_t>(), sp, bp, yp, M, N, K4, rs.data());
#endif
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

// A copy of t in memory the kernel may back with 2 MiB pages (madvise MADV_HUGEPAGE before the first touch): a
// decode step streams every packed weight once, and with 4 KiB pages a few hundred MB of weights cost a TLB miss per
// page. Most of a layer's weights are 0.5-4 MB, so they are placed one after another in shared 32 MiB regions (each
// freed with the last tensor in it); larger ones get their own. Tensors under 64 KiB, other systems and a refused
// allocation return t itself (the same values either way).
static bool g_huge_pages = true;
struct HugeRegion {
  void* base = nullptr;
  size_t cap = 0, used = 0;
  ~HugeRegion() { std::free(base); }
};
static std::shared_ptr<HugeRegion> huge_region(size_t len) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t HP = size_t(2) << 20;
  auto r = std::make_shared<HugeRegion>();
  r->cap = (len + HP - 1) / HP * HP;
  if (posix_memalign(&r->base, HP, r->cap) != 0) return nullptr;
  madvise(r->base, r->cap, MADV_HUGEPAGE);   // advice only: where the kernel says no, the pages stay 4 KiB
  return r;
#else
  (void)len;
  return nullptr;
#endif
}
torch::Tensor huge_pages(const torch::Tensor& t) {
  constexpr size_t REGION = size_t(32) << 20, ALIGN = 4096;
  static std::mutex mu;
  static std::shared_ptr<HugeRegion> open;   // the region being filled
  const size_t bytes = t.nbytes();
  if (!g_huge_pages || bytes < (size_t(64) << 10) || !t.is_contiguous() || t.device().type() != c10::DeviceType::CPU)
    return t;
  std::shared_ptr<HugeRegion> r;
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> g(mu);
    if (bytes > REGION / 2) {
      r = huge_region(bytes);
      if (r) p = r->base;
    } else {
      if (!open || open->used + bytes > open->cap) open = huge_region(REGION);
      if (open) {
        r = open;
        p = (char*)r->base + r->used;
        r->used += (bytes + ALIGN - 1) / ALIGN * ALIGN;
      }
    }
  }
  if (!r) return t;
  auto out = torch::from_blob(p, t.sizes(), [r](void*) mutable { r.reset(); }, t.options());
  out.copy_(t);
  return out;
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

// the first `bytes` of L's packed weights fetched into L2 (software prefetch, no wait): issued before work that
// reads little memory (attention, norms), so that L's first blocks are there when lin_rows starts on them
static inline void prefetch_lin(const Lin& L, int64_t bytes) {
  const char* p = (const char*)L.data.data_ptr();
  const int64_t n = std::min<int64_t>(bytes, L.data.numel() * L.data.element_size());
  for (int64_t b = 0; b < n; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

static void lin_rows(const Lin& L, const float* x, float* y, int64_t M) {
  const float* bp = L.bias.has_value() ? L.bias->data_ptr<float>() : nullptr;
  const float* sp = L.scale.has_value() ? L.scale->data_ptr<float>() : nullptr;
  run_mode(L.mode, x, L.data, sp, bp, y, M, L.N, L.K);
}
