// The native decode loops, generic over the model they run (LoopModel): greedy steps, blockwise steps for one row
// and for a batch; the encoder-decoder model's LoopModel (EncDecLoop) and entry points.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "sample_loop.h"

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
    head1_ids(h, M, d, nw, nb, eps, proj, out, full_logits());
  }
  int64_t vocab() const override { return proj.N; }
  bool move_row(int64_t dst, int64_t src, int64_t filled) const override {
    if (c.g != 1) return false;
    c.move_row(dst, src, filled);
    return true;
  }
  void propose(const float* h, int64_t M, int64_t n_heads, const int64_t* first, int64_t* out,
               float* lg = nullptr) const override {
    if (chain) return propose_chain_raw(h, M, d, *chain, first, n_heads, nw, nb, eps, *draft, dp, out, lg);
    const int64_t all = fc2->N / d;                  // the heads fc2 makes at once: keep the first n_heads
    if (n_heads >= all) return propose_raw(h, M, d, *fc1, *fc2, n_heads, nw, nb, eps, *draft, dp, out, lg);
    std::vector<int64_t> ids(M * all);
    std::vector<float> l(lg ? M * all * draft->N : 0);
    propose_raw(h, M, d, *fc1, *fc2, all, nw, nb, eps, *draft, dp, ids.data(), lg ? l.data() : nullptr);
    for (int64_t m = 0; m < M; m++) {
      std::copy(ids.data() + m * all, ids.data() + m * all + n_heads, out + m * n_heads);
      const int64_t V = draft->N;
      if (lg) std::copy(l.data() + m * all * V, l.data() + (m * all + n_heads) * V, lg + m * n_heads * V);
    }
  }
  int64_t draft_vocab() const override { return draft->N; }
  const int64_t* draft_map() const override { return dp; }
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
// at every row's end cost a Python round trip and a cache reorder each. The caches are left rearranged: the caller
// drops the state. Rows are independent (every row runs the same instructions whatever its place or its batch
// mates), so the tokens are the same. Returns (tokens [R, steps],
// each row's steps [R] int64, seconds).
// smp: sampled steps instead (the token drawn from head 1's sampling distribution, row r from rng row r of its
// input order), otherwise the same loop.
static std::tuple<torch::Tensor, torch::Tensor, double> greedy_loop(
    LoopModel& mdl, const torch::Tensor& tok, std::vector<int64_t> slot, const torch::Tensor& room,
    int64_t max_steps, std::chrono::steady_clock::time_point t_start, bool to_end = false,
    const Sampler* smp = nullptr) {
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
  std::vector<double> pbuf;
  mdl.keep_logits = smp != nullptr;
  int64_t s = 0, act = r;                        // act: rows still decoding (the first act of x, slot, id, ...)
  Tick tk;
  while (s < max_steps && act > 0) {
    mdl.embed(x.data(), slot.data(), act, h.data());
    tk.to(P_EMBED);
    mdl.layers(h.data(), act, 1, slot.data());
    tk = Tick();
    mdl.head1(h.data(), act, nxt.data());
    if (smp) {
      const int64_t V = mdl.vocab();
      double* pb = grow(pbuf, V);
      for (int64_t i = 0; i < act; i++) nxt[i] = smp->draw(work().logits.data() + i * V, V, id[i], pb);
    }
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
    int64_t max_steps, bool to_end, c10::optional<torch::Tensor> sampling, c10::optional<torch::Tensor> rng) {
  const auto t_start = std::chrono::steady_clock::now();
  TORCH_CHECK(!to_end || g == 1, "greedy_steps: to_end needs rows that do not share memory rows");
  EncDecLoop mdl(embed, embed_scale, pe, max_positions, layers, self_kv, mem_kv, mem_mask, g, nw, nb, eps, proj, eos);
  const auto smp = make_sampler(sampling, rng, tok.size(0));
  return greedy_loop(mdl, tok, first_slots(tok.size(0), t, lengths), room, max_steps, t_start, to_end, smp.get());
}

// The next step's candidate tree after head 1's token gn: the heads' ranked proposals at h along mdl.tree's rank
// paths, then `extra` (the lookup's next token, -1: none) as a branch of its own (LoopModel::tree_from).
static bool tree_block(const LoopModel& mdl, const float* h, int64_t gn, int64_t extra, std::vector<int64_t>& top,
                       std::vector<int64_t>& x, std::vector<int64_t>& par) {
  mdl.propose_top(h, mdl.tree_depth, mdl.tree_r, top.data());            // [depth][r]
  return mdl.tree_from(top.data(), gn, extra, x, par);
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
  const int64_t wm = std::max(std::max(w0, width), mdl.tree_nodes + 2);
  std::vector<int64_t> x(xt.data_ptr<int64_t>(), xt.data_ptr<int64_t>() + w0), toks, nc, slot(wm), gh(wm), prop(wm),
      look(wm), par, path, pslot(wm), top(std::max<int64_t>(1, mdl.tree_depth * mdl.tree_r));
  std::vector<uint64_t> anc(wm);
  auto lopt = torch::TensorOptions().dtype(torch::kLong);
  std::vector<float> h(wm * d), hn(d, 0.0f);
  int64_t ended = 0;
  bool is_tree = false;                                    // x is a candidate tree (par: each node's parent)
  for (int64_t s = 0; s < max_steps && !ended; s++) {
    const int64_t w = (int64_t)x.size();   // the first step may feed another width (the prefill: BOS alone)
    Tick tk;
    for (int64_t j = 0; j < w; j++) slot[j] = t + j;
    mdl.embed(x.data(), slot.data(), w, h.data());
    tk.to(P_EMBED);
    int64_t n = 0, last = 0;                               // proposals accepted; the row of the last one
    if (!is_tree) {
      mdl.layers(h.data(), w, w, slot.data());
      tk = Tick();
      int64_t done = 0, first = 0;                         // first: the position of the last head1 call's row 0
      for (;;) {
        if (n >= done) {                                   // head 1 at the next `group` positions
          const int64_t rows = std::min(group, w - done);
          mdl.head1(h.data() + done * d, rows, gh.data() + done);
          first = done;
          done += rows;
        }
        if (n < w - 1 && mdl.accepts(x[n + 1], gh[n], n - first) && (n == 0 || !mdl.stop(x[n]))) n++;
        else break;
      }
      last = n;
      path.resize(n);
      for (int64_t j = 0; j < n; j++) path[j] = j + 1;
    } else {
      for (int64_t j = 0; j < w; j++) {                    // rotary slot by depth; attention by ancestry
        pslot[j] = j == 0 ? t : pslot[par[j]] + 1;
        anc[j] = (j == 0 ? 0 : anc[par[j]]) | (uint64_t(1) << j);
      }
      mdl.layers_tree(h.data(), w, slot.data(), pslot.data(), anc.data());
      tk = Tick();
      mdl.head1(h.data(), w, gh.data());                   // every node: the accepted path is known only after
      path.clear();
      for (;;) {                                           // down the tree while a child is head 1's token
        if (n > 0 && mdl.stop(x[last])) break;
        int64_t nx = -1;
        for (int64_t c = last + 1; c < w && nx < 0; c++)
          if (par[c] == last && mdl.accepts(x[c], gh[last], last)) nx = c;
        if (nx < 0) break;
        path.push_back(nx);
        last = nx;
        n++;
      }
      for (int64_t i = 0; i < n; i++)                      // the chain's slots (sources lie beyond each target)
        if (path[i] != i + 1) mdl.move_slot(t + i + 1, t + path[i]);
    }
    tk.to(P_VERIFY);
    const int64_t gn = gh[last];
    const bool eos_in = n > 0 && mdl.stop(x[last]);
    const int64_t cnt = std::min<int64_t>(n + 1 - (eos_in ? 1 : 0), room);
    for (int64_t j = 0; j < cnt; j++) toks.push_back(j < n ? x[path[j]] : gn);
    mdl.extend(0, toks.data() + toks.size() - cnt, cnt);
    nc.push_back(n);
    nc.push_back(cnt);
    room -= cnt;
    t += cnt;
    ended = (eos_in || mdl.stop(gn) || room <= 0) ? 1 : 0;
    std::memcpy(hn.data(), h.data() + last * d, d * sizeof(float));
    x.assign(width, pad);
    x[0] = gn;
    is_tree = false;
    if (!ended && width > 1) {
      int64_t matched = 0;
      const int64_t got = mdl.lookup(0, width - 1, look.data(), &matched);
      if (!mdl.tree.empty() && matched < 2) {
        is_tree = tree_block(mdl, hn.data(), gn, matched == 1 && got > 0 ? look[0] : -1, top, x, par);
      } else {
        const int64_t wn = mdl.narrow >= 1 && matched < 2 ? std::min(mdl.narrow, width) : width;  // this step's rows
        x.resize(wn);
        if (wn > 1) mdl.propose(hn.data(), 1, wn - 1, &gn, prop.data());   // (narrow 1: a greedy step)
        if (matched >= 2 || wn == width) std::copy(look.data(), look.data() + std::min(got, wn - 1), prop.data());
        for (int64_t j = 0; j < wn - 1; j++) x[j + 1] = prop[j];
      }
    }
    if (g_prof) g_prof_steps += 1;
  }
  if (is_tree) {                                           // hand back the tree's leading chain (its top-1 path)
    int64_t len = 1;
    while (len < (int64_t)x.size() && par[len] == len - 1) len++;
    x.resize(len);
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
      mdl.extend(id[r], tp + id[r] * tw + cnt[id[r]], cn);
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
      for (int64_t a = 0; a < A; a++) {
        mdl.lookup(id[live[a]], width - 1, prop.data() + a * (width - 1));
        for (int64_t j = 0; j < width - 1; j++) x[live[a] * width + j + 1] = prop[a * (width - 1) + j];
      }
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
    int64_t width, const ChainProp* chain, int64_t top_n, double dist_eps, bool to_end,
    c10::optional<torch::Tensor> sampling, c10::optional<torch::Tensor> rng) {
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
  if (const auto smp = make_sampler(sampling, rng, x_in.size(0)))   // blockwise sampling, every row to its end
    return sample_block_loop(mdl, *smp, x_in.select(1, 0), t, lengths, room_in, max_steps, group, width, 0, t_start);
  return batch_block_loop(mdl, x_in, t, lengths, room_in, max_steps, group, width, t_start, to_end);
}
