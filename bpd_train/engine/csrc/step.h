// What every decode step shares: the per-phase profile, per-thread scratch buffers, layer norm, argmax and head 1's
// next token (argmax of the projection of the normed decoder output).
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "packed.h"

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

// Scratch buffers reused by every step (per thread): a small model's decode step is short enough that a dozen
// allocations per step showed in its time.
struct Work {
  std::vector<float> y, big, a, o;           // decoder stack
  std::vector<float> x, logits, n1;          // loops: decoder input/output, head-1 logits, normed rows
  std::vector<float> shi;                    // screened argmax: each output's upper bound
  std::vector<int64_t> scand;                // screened argmax: the outputs that can win
  std::vector<float> scz;                    // screened argmax: their exact outputs
  std::vector<float> sres, sq, scst;         // screened argmax: rows and residuals, a quantised row, per-row terms
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

// the r largest of l[0..V) (ties: the lower index first), best first -> out[0..r) (-1 past V)
template <typename T>
static void top_r_row(const T* l, int64_t V, int64_t r, int64_t* out) {
  for (int64_t i = 0; i < r; i++) out[i] = -1;
  for (int64_t v = 0; v < V; v++) {
    int64_t i = r;
    while (i > 0 && (out[i - 1] < 0 || l[v] > l[out[i - 1]])) i--;
    if (i >= r) continue;
    for (int64_t j = r - 1; j > i; j--) out[j] = out[j - 1];
    out[i] = v;
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
