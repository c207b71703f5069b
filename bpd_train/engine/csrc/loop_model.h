// LoopModel: what the native loops (loops.h, sample_loop.h) call per step, whatever the model they run.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "encdec.h"
#include "sample.h"

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
  bool keep_logits = false;                     // head1 leaves every row's full logits in work().logits (sampling)
  bool full_logits() const { return top_n > 0 || keep_logits; }
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
  // heads 1..n_heads at M positions -> ids [M][n_heads]; first [M]: head 1's token at each (chained heads read it);
  // lg: their logits over the draft vocabulary too, [M][n_heads][draft_vocab()]
  virtual void propose(const float* h, int64_t M, int64_t n_heads, const int64_t* first, int64_t* out,
                       float* lg = nullptr) const = 0;
  virtual int64_t draft_vocab() const = 0;          // the heads' logits' width
  virtual const int64_t* draft_map() const = 0;     // their columns' vocabulary ids (nullptr: the column is the id)
  // cache row dst = cache row src (its first `filled` self-cache slots), for loops that drop finished rows
  // themselves; false where this model's cache cannot (the caller then returns when a row ends)
  virtual bool move_row(int64_t, int64_t, int64_t) const { return false; }
  // Prompt lookup: each row's context (prompt and tokens so far, by the row's place in the call's input); where
  // the context's last n (lookup_n, else fewer, down to 1) tokens occurred before, the tokens that followed them
  // there are the proposals, the heads' only past their end. Proposals only choose what head 1 verifies.
  // narrow >= 1 (one row only): a step whose context repeats fewer than 2 tokens feeds `narrow` rows, the heads'
  // proposals alone (a one-token match predicts little; the rows it saves cost more than they gain); 1: a greedy step.
  int64_t lookup_n = 0, narrow = 0;
  // Candidate trees (decoder-only, one row): a step whose context repeats fewer than 2 tokens feeds the root and a
  // tree of the heads' ranked proposals (rank paths, one rank per head from head 1 down, in depth-first order with
  // the better rank first, so the top-1 chain comes first), plus the lookup's next token as one more branch where
  // the last token repeats. Every node attends to the context and its own ancestors; the accepted path's K/V then
  // move to the slots a chain would have used.
  std::vector<std::vector<int64_t>> tree;
  int64_t tree_r = 0, tree_depth = 0, tree_nodes = 0;
  void set_tree(const c10::optional<torch::Tensor>& paths) {
    tree.clear();
    tree_r = tree_depth = tree_nodes = 0;
    if (!paths.has_value() || paths->numel() == 0) return;
    auto pt = paths->to(torch::kLong).contiguous();
    TORCH_CHECK(pt.dim() == 2, "candidate tree: rank paths [P, depth] (-1 pads)");
    const int64_t* v = pt.data_ptr<int64_t>();
    std::set<std::vector<int64_t>> nodes;
    for (int64_t i = 0; i < pt.size(0); i++) {
      std::vector<int64_t> path;
      for (int64_t j = 0; j < pt.size(1) && v[i * pt.size(1) + j] >= 0; j++) {
        path.push_back(v[i * pt.size(1) + j]);
        nodes.insert(path);
        tree_r = std::max(tree_r, path.back() + 1);
      }
      tree_depth = std::max<int64_t>(tree_depth, (int64_t)path.size());
      if (!path.empty()) tree.push_back(path);
    }
    std::sort(tree.begin(), tree.end());
    tree_nodes = (int64_t)nodes.size();
    TORCH_CHECK(tree_nodes <= 62, "candidate tree: at most 62 nodes (", tree_nodes, " given)");
  }
  // A step's candidate tree from ranked proposals top [tree_depth][tree_r] (-1: no proposal of that rank): x = [root,
  // nodes...] along the rank paths, then `extra` (-1: none) as a branch of its own; par = each node's parent row.
  // Returns false where the tree came out a plain chain.
  bool tree_from(const int64_t* top, int64_t root, int64_t extra, std::vector<int64_t>& x,
                 std::vector<int64_t>& par) const {
    x.assign(1, root);
    par.assign(1, -1);
    auto child = [&](int64_t p, int64_t tok) {             // p's child holding tok, added if new
      for (int64_t c = p + 1; c < (int64_t)x.size(); c++)
        if (par[c] == p && x[c] == tok) return c;
      x.push_back(tok);
      par.push_back(p);
      return (int64_t)x.size() - 1;
    };
    for (const auto& path : tree) {
      int64_t cur = 0;
      for (size_t dd = 0; dd < path.size(); dd++) {
        const int64_t tok = top[dd * tree_r + path[dd]];
        if (tok < 0) break;
        cur = child(cur, tok);
      }
    }
    if (extra >= 0) child(0, extra);
    for (int64_t j = 1; j < (int64_t)x.size(); j++)
      if (par[j] != j - 1) return true;
    return false;
  }
  virtual void propose_top(const float*, int64_t, int64_t, int64_t*) const {
    TORCH_CHECK(false, "candidate trees: decoder-only models only");
  }
  // x [M][d] in place: a candidate tree's M nodes fed at slots slot[0].. (see lm_decode_raw)
  virtual void layers_tree(float*, int64_t, const int64_t*, const int64_t*, const uint64_t*) const {
    TORCH_CHECK(false, "candidate trees: decoder-only models only");
  }
  virtual void move_slot(int64_t, int64_t) const { TORCH_CHECK(false, "candidate trees: decoder-only models only"); }
  mutable std::vector<std::vector<int64_t>> ctx;
  void set_context(const std::vector<torch::Tensor>& rows, int64_t n, int64_t narrow_rows = 0) {
    lookup_n = n > 0 && !rows.empty() ? n : 0;
    narrow = lookup_n > 0 ? narrow_rows : 0;
    ctx.clear();
    for (const auto& r : rows) {
      auto c = r.to(torch::kLong).contiguous();
      ctx.emplace_back(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    }
  }
  void extend(int64_t row, const int64_t* t, int64_t c) const {
    if (lookup_n > 0 && row < (int64_t)ctx.size()) ctx[row].insert(ctx[row].end(), t, t + c);
  }
  // proposals for row `row` into out[0..want) where its context says something: returns how many (0: none);
  // matched (if given): the length of the repeat they follow (0: none)
  int64_t lookup(int64_t row, int64_t want, int64_t* out, int64_t* matched = nullptr) const {
    if (matched) *matched = 0;
    if (lookup_n <= 0 || row >= (int64_t)ctx.size()) return 0;
    const std::vector<int64_t>& c = ctx[row];
    const int64_t L = (int64_t)c.size();
    for (int64_t n = std::min<int64_t>(lookup_n, L - 1); n >= 1; n--) {
      const int64_t* key = c.data() + L - n;
      for (int64_t j = L - n - 1; j >= 0; j--) {      // the latest earlier occurrence
        if (!std::equal(key, key + n, c.data() + j)) continue;
        const int64_t got = std::min<int64_t>(want, L - (j + n));
        std::copy(c.data() + j + n, c.data() + j + n + got, out);
        if (matched) *matched = n;
        return got;
      }
    }
    return 0;
  }
};

static std::vector<int64_t> stop_list(const torch::Tensor& stops) {
  auto s = stops.to(torch::kLong).contiguous();
  return std::vector<int64_t>(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
}

