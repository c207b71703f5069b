// Native sampling: the distribution decoding/sampling.py's sampling_probs defines (softmax(logits / T) within
// top_k, then top_p, renormalised) and a random stream per row, for the native loops' sampled steps.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "step.h"
#include <algorithm>
#include <cfloat>
#include <functional>
#include <memory>

namespace {

// splitmix64's output function: a 64-bit bijection whose outputs look independent for consecutive inputs
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// the largest of x[0..n) ignoring NaNs (as a std::max loop from -inf), 16 lanes at a time
static inline float max_of(const float* x, int64_t n) {
  float m = -INFINITY;
  vf mv = vbcast(&m);
  int64_t v = 0;
  for (; v + L <= n; v += L) mv = vmax(vload(x + v), mv);   // (a NaN in x: max returns the second operand)
  m = hmax(mv);
  for (; v < n; v++) m = std::max(m, x[v]);
  return m;
}

struct Sampler {
  double temp = 1.0, top_p = 1.0;
  int64_t top_k = 0;
  // [rows][2]: each row's seed and its counter (advanced in place): the uniforms it has drawn (speculative
  // verification) or the tokens it has chosen (choose: plain steps and match verification)
  int64_t* rng = nullptr;
  bool match = false;       // blockwise sampling keeps a draft only where it is the token choose() picks there
  mutable std::vector<float> xf, tf;
  struct QId {
    double q;
    int64_t id;
  };
  mutable std::vector<double> ub;
  mutable std::vector<QId> rank;

  // Row `row`'s next uniform in [0, 1): the splitmix64 sequence keyed by its seed, at its own counter, so a row's
  // numbers depend on its seed and its own draws only (never on its batch mates)
  double uniform(int64_t row) const {
    const uint64_t key = mix64((uint64_t)rng[2 * row] + 0x9E3779B97F4A7C15ULL);
    const uint64_t c = (uint64_t)rng[2 * row + 1]++;
    return (double)(mix64(key + (c + 1) * 0x9E3779B97F4A7C15ULL) >> 11) * 0x1.0p-53;
  }

  // Row `row`'s exponentials at output position pos are hashes of (seed, pos, id): the key of (seed, pos) here,
  // one_minus_u(key, v) for id v. So the noise of a position is fixed before anything is drafted or fed.
  uint64_t pos_key(int64_t row, int64_t pos) const {
    const uint64_t seed = mix64((uint64_t)rng[2 * row] + 0x9E3779B97F4A7C15ULL);
    return mix64(seed + (uint64_t)(pos + 1) * 0xD1B54A32D192ED03ULL);
  }
  // t1 = 1 - U (U uniform in (0, 1]) for id v: a lower bound of E = -log U that needs no log
  static double one_minus_u(uint64_t key, int64_t v) {
    return (double)(mix64(key + (uint64_t)(v + 1) * 0x9E3779B97F4A7C15ULL) >> 11) * 0x1.0p-53;
  }

  // The token at output position pos of row `row`, given the sampling distribution w [n] (normalised, 0 outside
  // top-k / top-p) over ids map[0..n) (or 0..n): the exponential race argmax w(v) / E(pos, v), a draw from w
  // whose randomness is keyed by (seed, pos, id). Two distributions at the same position share E, so a draft chosen
  // this way from the heads' q is the model's own choice wherever q and p agree (a Gumbel coupling of q and p).
  int64_t race(const double* w, int64_t n, const int64_t* map, int64_t row, int64_t pos) const {
    const uint64_t key = pos_key(row, pos);
    double* t = grow(ub, n);                               // 1 - U of every id, in one branch-free pass
    if (map) {
      for (int64_t c = 0; c < n; c++) t[c] = one_minus_u(key, map[c]);
    } else {
      for (int64_t c = 0; c < n; c++) t[c] = one_minus_u(key, c);
    }
    int64_t best = -1;
    double score = 0.0;                                    // w(best) / E(best)
    int64_t top = 0;                                       // the likeliest id first: a high score prunes the rest
    for (int64_t c = 1; c < n; c++) if (w[c] > w[top]) top = c;
    auto visit = [&](int64_t c) {
      if (!(w[c] > 0.0)) return;
      const double t1 = t[c];
      if (best >= 0 && t1 * score >= w[c]) return;        // E >= 1 - U: this id cannot win
      const double e = -std::log1p(-t1);                  // E = -log U
      if (best < 0 || w[c] > score * e) { best = c; score = w[c] / e; }
    };
    visit(top);
    for (int64_t c = 0; c < n; c++) if (c != top) visit(c);
    return best;
  }

  // The r ids of w [n] (over ids map, or 0..n) most likely to be drawn at output position pos of row `row`, best
  // first, into out[0..r) (indices into w; -1 past the ids of weight > 0): by w itself, or with race, by the race
  // score w / E(pos, id) that choose() maximises there (the candidates a tree offers for match verification).
  void ranked(const double* w, int64_t n, const int64_t* map, int64_t row, int64_t pos, int64_t r, bool by_race,
              int64_t* out) const {
    const uint64_t key = by_race ? pos_key(row, pos) : 0;
    double* sc = grow(ub, n);
    for (int64_t c = 0; c < n; c++)
      sc[c] = !(w[c] > 0.0) ? -1.0 : by_race ? w[c] / -std::log1p(-one_minus_u(key, map ? map[c] : c)) : w[c];
    top_r_row(sc, n, r, out);
    for (int64_t i = 0; i < r; i++) if (out[i] >= 0 && sc[out[i]] < 0.0) out[i] = -1;   // (weight 0: never drawn)
  }

  // row `row`'s token at output position pos, chosen from the sampling distribution of logits l [n] over ids map
  // (or 0..n); buf [n] is scratch. Returns the index into l (map it for the id).
  int64_t choose(const float* l, int64_t n, const int64_t* map, int64_t row, int64_t pos, double* buf) const {
    probs(l, n, buf);
    return race(buf, n, map, row, pos);
  }

  // out[0..V) = the sampling distribution of logits l [V] (normalised; 0 outside top_k / top_p): sampling_probs,
  // with the scaled logits and their exps in float (vexp: a std::exp per id was most of a small model's step)
  void probs(const float* l, int64_t V, double* out) const {
    // shifted by the largest logit first (softmax does not change), so a tiny temperature gives 0 and -inf, never
    // inf - inf
    const float it = (float)std::min(1.0 / temp, (double)FLT_MAX);
    const float lmax = max_of(l, V);
    float* x = grow(xf, V);
    for (int64_t v = 0; v < V; v++) x[v] = (l[v] - lmax) * it;
    float kth = -INFINITY;
    if (top_k > 0 && top_k < V) {                       // the k-th largest scaled logit: ties with it are kept
      float* t = grow(tf, V);
      std::copy(x, x + V, t);
      std::nth_element(t, t + top_k - 1, t + V, std::greater<float>());
      kth = t[top_k - 1];
    }
    if (kth > -INFINITY)
      for (int64_t v = 0; v < V; v++) if (x[v] < kth) x[v] = -INFINITY;
    const float mx = max_of(x, V);
    const vf vm = vbcast(&mx);
    int64_t v = 0;
    for (; v + L <= V; v += L) vstore(x + v, vexp(vsub(vload(x + v), vm)));   // (-inf lanes give 0)
    for (; v < V; v++) x[v] = x[v] == -INFINITY ? 0.0f : std::exp(x[v] - mx);
    for (int64_t u = 0; u < V; u++) out[u] = (double)x[u];
    const double s = sum8(out, V);                      // (eight running sums in a fixed order: step.h)
    for (int64_t u = 0; u < V; u++) out[u] /= s;
    if (top_p < 1.0) nucleus(out, V);
  }

  // the ids of r [n] (q side by side) whose q >= f, for the highest f = 2^-(b+1) with mass(q >= f) >= top_p: their
  // probabilities summed by binary order of magnitude (bucket b: q in [2^-(b+1), 2^-b)), f the lower edge of the
  // bucket where the sum from the top reaches top_p (the ranking checks the sum again). Returns the ids kept.
  int64_t above_floor(QId* r, int64_t n) const {
    double mass[64] = {};
    for (int64_t i = 0; i < n; i++) {
      int e;
      std::frexp(r[i].q, &e);                            // q in [2^(e-1), 2^e)
      mass[std::min(63, std::max(0, -e))] += r[i].q;
    }
    double above = 0.0;
    int b = 0;
    for (; b < 63 && (above += mass[b]) < top_p; b++) {}
    const double f = std::ldexp(1.0, -(b + 1));
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) if (r[i].q >= f) r[k++] = r[i];
    return k;
  }

  // keep the most likely tokens (ties by id) ranked before the probability ranked above them reaches top_p, then
  // renormalise. Ranked: the ids of q >= (1 - top_p) / V alone (and of those, where many, the binades the nucleus
  // reaches). They rank before every other id and the others hold less than 1 - top_p, so the nucleus ends among
  // them, with the same ranks and sums as over every id; where rounding says otherwise, every id of q > 0 is
  // ranked. Their first 64 ranks are sorted, all of them where the nucleus ends further down.
  void nucleus(double* q, int64_t V) const {
    QId* r = grow(rank, V);                             // (probability, id) side by side: the sort reads no q[id]
    auto before = [](const QId& a, const QId& b) { return a.q > b.q || (a.q == b.q && a.id < b.id); };
    int64_t size = 0;
    auto cut = [&](double floor) {                      // -> whether the nucleus ends among the ids ranked
      int64_t n = 0;
      for (int64_t v = 0; v < V; v++) if (q[v] > 0.0 && q[v] >= floor) r[n++] = {q[v], v};
      if (floor > 0.0 && n > 256) n = above_floor(r, n);  // (many ids: only the binades the nucleus reaches)
      int64_t m = std::min<int64_t>(n, 64);
      while (true) {
        if (m < n) std::partial_sort(r, r + m, r + n, before);
        else std::sort(r, r + n, before);
        double above = 0.0;
        size = 0;
        for (; size < m && above < top_p; size++) above += r[size].q;
        if (above >= top_p) return true;                // the nucleus ends within the first m ranks
        if (m == n) return false;
        m = n;                                          // the rest of the few ids above the floor: all sorted
      }
    };
    if (!cut((1.0 - top_p) / (double)V)) cut(0.0);
    double s = 0.0;
    for (int64_t i = 0; i < size; i++) s += r[i].q;
    std::fill(q, q + V, 0.0);
    for (int64_t i = 0; i < size; i++) q[r[i].id] = r[i].q / s;
  }

  // an id drawn from the non-negative weights w [V] (unnormalised) with uniform u: the first id whose running sum
  // (in id order) passes u * total (decoding/speculative.py's draw); an id of weight 0 is never drawn (-1: all are)
  static int64_t pick(const double* w, int64_t V, double u) {
    double total = 0.0;
    int64_t last = -1;
    for (int64_t v = 0; v < V; v++) if (w[v] > 0.0) { total += w[v]; last = v; }
    const double at = u * total;
    double c = 0.0;
    for (int64_t v = 0; v < V; v++) {
      if (w[v] <= 0.0) continue;
      c += w[v];
      if (c > at) return v;
    }
    return last;
  }

  // row `row`'s next token in plain sampled steps: choose() at the row's counter, which then advances
  int64_t draw(const float* l, int64_t V, int64_t row, double* buf) const {
    return choose(l, V, nullptr, row, rng[2 * row + 1]++, buf);
  }
};

// The native loops' sampling distribution of each row of logits [R, V] (float32) as float64 [R, V]: Sampler::probs
// (for tests against decoding/sampling.py's sampling_probs)
static torch::Tensor sampling_probs(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p) {
  TORCH_CHECK(logits.dim() == 2 && temperature > 0.0 && top_k >= 0 && top_p > 0.0 && top_p <= 1.0,
              "sampling_probs: logits [R, V], temperature > 0, top_k >= 0, 0 < top_p <= 1");
  auto l = logits.to(torch::kFloat32).contiguous();
  auto out = torch::empty(l.sizes(), l.options().dtype(torch::kDouble));
  Sampler smp;
  smp.temp = temperature;
  smp.top_k = top_k;
  smp.top_p = top_p;
  const int64_t R = l.size(0), V = l.size(1);
  for (int64_t r = 0; r < R; r++) smp.probs(l.data_ptr<float>() + r * V, V, out.data_ptr<double>() + r * V);
  return out;
}

// The sampling settings the entry points take: s = [temperature, top_k, top_p(, match)] (float64), rng [rows, 2]
// int64 (seed, counter) or none for greedy decoding
static std::unique_ptr<Sampler> make_sampler(const c10::optional<torch::Tensor>& s,
                                             const c10::optional<torch::Tensor>& rng, int64_t rows) {
  if (!s.has_value() || !s->defined() || s->numel() == 0) return nullptr;
  auto sv = s->to(torch::kDouble).contiguous();
  TORCH_CHECK(sv.numel() == 3 || sv.numel() == 4, "sampling: [temperature, top_k, top_p(, match)]");
  const double* v = sv.data_ptr<double>();
  TORCH_CHECK(v[0] > 0.0 && v[1] >= 0.0 && v[2] > 0.0 && v[2] <= 1.0,
              "sampling: temperature > 0, top_k >= 0, 0 < top_p <= 1");
  TORCH_CHECK(rng.has_value() && rng->scalar_type() == torch::kLong && rng->is_contiguous() && rng->dim() == 2 &&
                  rng->size(0) == rows && rng->size(1) == 2,
              "sampling: rng must be a contiguous int64 [rows, 2] tensor (seed, draws)");
  auto out = std::make_unique<Sampler>();
  out->temp = v[0];
  out->top_k = (int64_t)v[1];
  out->top_p = v[2];
  out->match = sv.numel() == 4 && v[3] != 0.0;
  out->rng = rng->data_ptr<int64_t>();
  return out;
}

}  // namespace
