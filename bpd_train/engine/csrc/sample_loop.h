// Blockwise sampling in one native call: decoding/speculative.py's algorithm (speculative sampling with the heads'
// drafts and prompt lookup's), generic over the model it runs (LoopModel), every row to its end.
// A part of the decode extension's one translation unit: linear.cpp includes every part in order, and
// fastlinear.py compiles linear.cpp alone.
#pragma once
#include "loop_model.h"

// One candidate tree's step for a call's one row (cache row 0; sample_block_loop's trees): feed the tree x [w] (par:
// each node's parent) at slots base.., then from the root down draw each reached node's token from p and follow the
// child holding it, never past a stop id (head 1 at every node in one pass where `group` covers them, as the chain's
// lazy verification groups positions; else node by node as reached). match: the token is smp.choose's race at its
// place (place: the root's output position). Else, where the reached node's children hold its depth's draw from
// the heads' q (col[n], a column of q [depth][Vd] over ids dmap), speculative verification of that draw (min(1, p/q),
// else the residual max(0, p - q)); else a draw from p. Out: dr[0..n) the accepted nodes' tokens, last the last
// one's row of h, nxt the token drawn there (unused after a stop id), ids[0] head 1's argmax there; the path's K/V
// moved to a chain's slots.
static void sample_tree_step(const LoopModel& mdl, const Sampler& smp, const std::vector<int64_t>& x,
                             const std::vector<int64_t>& par, int64_t base, int64_t place, int64_t row,
                             std::vector<float>& h, std::vector<double>& p, std::vector<int64_t>& slot,
                             std::vector<int64_t>& pslot, std::vector<uint64_t>& anc, std::vector<int64_t>& path,
                             std::vector<int64_t>& ids, int64_t group, const double* q, const int64_t* col,
                             int64_t depth, const int64_t* dmap, int64_t Vd, std::vector<double>& res, int64_t* dr,
                             int64_t& n, int64_t& last, int64_t& nxt) {
  const int64_t w = (int64_t)x.size(), d = mdl.d, V = mdl.vocab();
  auto child = [&](int64_t node, int64_t tok) {      // node's child holding tok (w: none)
    int64_t c = node + 1;
    while (c < w && !(par[c] == node && x[c] == tok)) c++;
    return c;
  };
  slot.resize(w);
  pslot.resize(w);
  anc.resize(w);
  for (int64_t j = 0; j < w; j++) {                  // rotary slot by depth; attention by ancestry
    slot[j] = base + j;
    pslot[j] = j == 0 ? base : pslot[par[j]] + 1;
    anc[j] = (j == 0 ? 0 : anc[par[j]]) | (uint64_t(1) << j);
  }
  Tick tk;
  grow(h, w * d);
  mdl.embed(x.data(), slot.data(), w, h.data());
  tk.to(P_EMBED);
  mdl.layers_tree(h.data(), w, slot.data(), pslot.data(), anc.data());
  tk = Tick();
  const bool all = group >= w;
  grow(ids, w);
  if (all) mdl.head1(h.data(), w, ids.data());
  n = 0;
  last = 0;
  path.clear();
  for (;;) {                                         // the reached node's draw picks the child
    if (!all) mdl.head1(h.data() + last * d, 1, ids.data() + last);
    const float* l = work().logits.data() + (all ? last * V : 0);
    if (smp.match) {
      nxt = smp.choose(l, V, nullptr, row, place + n, p.data());
    } else {
      smp.probs(l, V, p.data());
      const int64_t sid = n < depth ? (dmap ? dmap[col[n]] : col[n]) : -1;   // the depth's draw from q
      const int64_t c = child(last, sid);
      const double* qn = q + n * Vd;
      const double u = smp.uniform(row);
      if (c < w && u * qn[col[n]] < p[sid]) {
        nxt = sid;
      } else if (c < w) {                            // rejected: the residual max(0, p - q)
        std::copy(p.begin(), p.begin() + V, res.begin());
        for (int64_t j = 0; j < Vd; j++) {
          const int64_t v = dmap ? dmap[j] : j;
          res[v] = std::max(0.0, p[v] - qn[j]);
        }
        const double u2 = smp.uniform(row);
        nxt = Sampler::pick(res.data(), V, u2);
        if (nxt < 0) nxt = Sampler::pick(p.data(), V, u2);   // (a residual rounded to nothing: p itself)
      } else {
        nxt = Sampler::pick(p.data(), V, u);
      }
    }
    const int64_t c = child(last, nxt);
    if (c >= w) break;
    path.push_back(c);
    dr[n++] = x[c];
    last = c;
    if (mdl.stop(x[c])) break;                       // nothing follows a stop id
  }
  ids[0] = ids[last];
  for (int64_t i = 0; i < n; i++)                    // the chain's slots (sources lie beyond each target)
    if (path[i] != i + 1) mdl.move_slot(base + i + 1, base + path[i]);
  tk.to(P_VERIFY);
}

// R rows in per-row cache mode, each fed its start token (BOS, or a prompt's last token) at slot t + lengths[r]. A
// step feeds each row x0 (its last token) and its drafts d1..d(b-1) (b: the widest row's width this step) and
// verifies lazily, `group` positions of the rows still accepting at a time: draft d(j+1) is accepted with
// probability min(1, p_j(d) / q(d)), p_j head 1's sampling distribution at position j (smp.probs), never after a
// stop id nor past the row's width; at the first rejection the next token is drawn from max(0, p_j - q), after a
// fully accepted block from p (the bonus token). The heads at the last accepted position then draft the next block,
// head i's token drawn from q_i, its sampling distribution over the draft vocabulary; where the context repeats
// (mdl.lookup) the tokens that followed take the first places with q a point mass; with narrow >= 1 a row whose
// context repeats fewer than 2 tokens verifies its heads' first narrow - 1 drafts only (narrow 1: a plain step).
// smp.match instead keeps draft d(j+1) only where it is smp.choose's token at that place (the heads draft by the same
// race over q_i), the next token being that choice: the rows' tokens are then plain sampling's (greedy_loop's draw).
// Candidate trees (mdl.tree, a call of one row): a step whose context repeats fewer than 2 tokens feeds the last
// token and a tree of the heads' candidates instead (LoopModel::tree_from; rank 0 at each depth is the draft a
// chain would feed there, the other ranks q's likeliest others, or for match the race's likeliest winners), every
// node attending to the context and its ancestors. From the root down, the token at each reached node is drawn
// from p there (sample_tree_step: match's race, or speculative verification of the depth's draft) and the path goes
// on into the child holding it: every token is a draw from p given its prefix, the candidates only decide how many
// come out of the step. The accepted path's K/V then move to a chain's slots.
// Each row draws from its own stream (smp.uniform, by its place in the input), its width and drafts depend on its own
// tokens only, and finished rows leave (the last row's cache moved into their place), so a row's tokens never
// depend on its batch mates.
// Returns (tokens [R, T] of which the first counts[r] are row r's, histogram [kb + 1] of the tokens rows gained per
// step, steps [1], empty, counts [R], seconds): batch_block_loop's to_end return.
static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double> sample_block_loop(
    LoopModel& mdl, const Sampler& smp, torch::Tensor tok_in, int64_t t, torch::Tensor lengths, torch::Tensor room_in,
    int64_t max_steps, int64_t group, int64_t kb, int64_t narrow, std::chrono::steady_clock::time_point t_start) {
  auto tt = tok_in.to(torch::kLong).contiguous().view({-1});
  const int64_t R0 = tt.size(0), d = mdl.d, V = mdl.vocab(), nh = kb - 1;
  TORCH_CHECK(kb >= 2, "blockwise sampling: a block of at least 2");
  const int64_t Vd = mdl.draft_vocab();
  const int64_t* dmap = mdl.draft_map();
  auto lt = lengths.to(torch::kLong).contiguous();
  auto rt = room_in.to(torch::kLong).contiguous();
  TORCH_CHECK(lt.numel() == R0 && rt.numel() == R0, "blockwise sampling: lengths and room must be [R]");
  group = std::max<int64_t>(1, group);
  mdl.keep_logits = true;
  int64_t R = R0;
  std::vector<int64_t> x0(tt.data_ptr<int64_t>(), tt.data_ptr<int64_t>() + R0), len(lt.data_ptr<int64_t>(),
      lt.data_ptr<int64_t>() + R0), room(rt.data_ptr<int64_t>(), rt.data_ptr<int64_t>() + R0), id(R0), wid(R0, 1);
  std::vector<int64_t> dr(R0 * nh, x0.empty() ? 0 : x0[0]), look(R0 * nh, 0), cnt(R0, 0);
  std::vector<int64_t> hist(kb + 1, 0), n(R0), ended(R0), act, nact, ids, fed, slot, tmp(nh);
  std::vector<double> qd(R0 * nh, 1.0), q((size_t)R0 * nh * Vd, 0.0), p((size_t)R0 * V), res(V);
  std::vector<float> h, hv, lg;
  std::vector<int64_t> cho(R0, -1), pos0(R0), hrow(R0, 0);
  // a candidate tree's step (one row): its tokens, each node's parent, rotary slot and ancestors, the accepted path
  const bool trees = R0 == 1 && !mdl.tree.empty();
  bool is_tree = false;
  std::vector<int64_t> tx, par, path, tslot, pslot, top(std::max<int64_t>(1, mdl.tree_depth * mdl.tree_r));
  std::vector<uint64_t> anc;
  std::vector<int64_t> tcol(std::max<int64_t>(1, mdl.tree_depth)), trk(mdl.tree_r + 1);
  for (int64_t r = 0; r < R0; r++) { id[r] = r; pos0[r] = smp.rng[2 * r + 1]; }
  auto lopt = torch::TensorOptions().dtype(torch::kLong);
  const int64_t tw = std::max<int64_t>(max_steps, 1) * kb;
  auto toks = torch::zeros({R0, tw}, lopt);
  int64_t* tp = toks.data_ptr<int64_t>();
  int64_t s = 0;
  for (; s < max_steps && R > 0; s++) {
    Tick tk;
    int64_t B = 1;
    if (is_tree) {
      sample_tree_step(mdl, smp, tx, par, t + len[0], pos0[id[0]] + cnt[id[0]], id[0], h, p, tslot, pslot, anc, path,
                       ids, group, q.data(), tcol.data(), mdl.tree_depth, dmap, Vd, res, dr.data(), n[0], hrow[0],
                       cho[0]);
    } else {
      for (int64_t r = 0; r < R; r++) B = std::max(B, wid[r]);
      fed.resize(R * B);
      slot.resize(R * B);
      for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < B; j++) {
          fed[r * B + j] = j == 0 ? x0[r] : dr[r * nh + j - 1];
          slot[r * B + j] = t + len[r] + j;
        }
      grow(h, R * B * d);
      mdl.embed(fed.data(), slot.data(), R * B, h.data());
      tk.to(P_EMBED);
      mdl.layers(h.data(), R * B, B, slot.data());
      tk = Tick();
      // lazy verification: head 1 at positions done..done+cols-1 of the rows still accepting
      act.resize(R);
      for (int64_t r = 0; r < R; r++) { act[r] = r; n[r] = 0; }
      for (int64_t done = 0; !act.empty(); done += group) {
        const int64_t cols = std::min(group, B - done), A = (int64_t)act.size();
        grow(hv, A * cols * d);
        grow(ids, A * cols);
        for (int64_t a = 0; a < A; a++)
          std::memcpy(hv.data() + a * cols * d, h.data() + (act[a] * B + done) * d, cols * d * sizeof(float));
        mdl.head1(hv.data(), A * cols, ids.data());
        nact.clear();
        for (int64_t a = 0; a < A; a++) {
          const int64_t r = act[a];
          double* pr = p.data() + r * V;
          bool going = true;
          for (int64_t j = done; j < done + cols && going; j++) {
            const float* lj = work().logits.data() + (a * cols + j - done) * V;
            n[r] = j;
            going = j < wid[r] - 1 && !(j > 0 && mdl.stop(fed[r * B + j]));
            if (smp.match) {                           // the token chosen at position j: kept where drafted
              cho[r] = smp.choose(lj, V, nullptr, id[r], pos0[id[r]] + cnt[id[r]] + j, pr);
              going = going && cho[r] == dr[r * nh + j];
            } else {
              smp.probs(lj, V, pr);                    // p_j
              going = going && smp.uniform(id[r]) * qd[r * nh + j] < pr[dr[r * nh + j]];
            }
            if (going) n[r] = j + 1;
          }
          if (going && n[r] < B) nact.push_back(r);    // every draft so far accepted: p at the next position needed
        }
        act.swap(nact);
      }
      for (int64_t r = 0; r < R; r++) hrow[r] = r * B + n[r];
      tk.to(P_VERIFY);
    }
    // each row's tokens: its accepted drafts, then a draw from the residual (or the bonus from p)
    for (int64_t r = 0; r < R; r++) {
      const int64_t m = n[r];
      const bool eos_in = m > 0 && mdl.stop(dr[r * nh + m - 1]);
      int64_t nxt = -1;
      if (!eos_in && (smp.match || is_tree)) {
        nxt = cho[r];                                // the choice at the first place not kept (or the bonus)
      } else if (!eos_in) {
        const double* pr = p.data() + r * V;
        std::copy(pr, pr + V, res.begin());
        if (m < wid[r] - 1) {                        // rejected at m: max(0, p - q)
          if (look[r * nh + m]) {
            res[dr[r * nh + m]] = 0.0;
          } else {
            const double* qm = q.data() + ((size_t)r * nh + m) * Vd;
            for (int64_t c = 0; c < Vd; c++) {
              const int64_t v = dmap ? dmap[c] : c;
              res[v] = std::max(0.0, pr[v] - qm[c]);
            }
          }
        }
        const double u = smp.uniform(id[r]);
        nxt = Sampler::pick(res.data(), V, u);
        if (nxt < 0) nxt = Sampler::pick(pr, V, u);   // (a residual rounded to nothing: p itself)
      }
      const int64_t cn = std::min<int64_t>(m + (eos_in ? 0 : 1), room[r]);
      int64_t* out = tp + id[r] * tw + cnt[id[r]];
      for (int64_t j = 0; j < cn; j++) out[j] = j < m ? dr[r * nh + j] : nxt;
      mdl.extend(id[r], out, cn);
      cnt[id[r]] += cn;
      hist[cn] += 1;
      room[r] -= cn;
      len[r] += cn;
      ended[r] = (eos_in || mdl.stop(nxt) || room[r] <= 0) ? 1 : 0;
      x0[r] = nxt;
      n[r] = m;
    }
    // the next drafts, at each live row's last accepted position
    act.clear();
    for (int64_t r = 0; r < R; r++) if (!ended[r]) act.push_back(r);
    const int64_t A = (int64_t)act.size();
    is_tree = false;
    int64_t got0 = -1, matched0 = 0;                 // (one row with trees: its lookup, done once a step)
    if (A > 0 && trees) {                            // one row: a tree where its context repeats fewer than 2 tokens
      got0 = mdl.lookup(id[0], nh, tmp.data(), &matched0);
      if (matched0 < 2) {
        is_tree = true;
        wid[0] = 1;
        const int64_t dep = mdl.tree_depth, rk = mdl.tree_r;
        grow(ids, dep);
        grow(lg, dep * Vd);
        Tick tp2;
        mdl.propose(h.data() + hrow[0] * d, 1, dep, x0.data(), ids.data(), lg.data());
        tp2.to(P_PROPOSE_PROJ);
        // each depth's candidates (q over the draft vocabulary: row 0's slots of q). match: the likeliest winners
        // of the race at its place; else a draw from q first (verified as a chain's draft), then q's likeliest others
        for (int64_t dd = 0; dd < dep; dd++) {
          double* qd_ = q.data() + dd * Vd;
          int64_t* tr = top.data() + dd * rk;
          smp.probs(lg.data() + dd * Vd, Vd, qd_);
          if (smp.match) {
            smp.ranked(qd_, Vd, dmap, id[0], pos0[id[0]] + cnt[id[0]] + dd, rk, true, tr);
          } else {
            tcol[dd] = Sampler::pick(qd_, Vd, smp.uniform(id[0]));
            smp.ranked(qd_, Vd, nullptr, 0, 0, rk + 1, false, trk.data());
            std::fill(tr, tr + rk, -1);
            tr[0] = tcol[dd];
            for (int64_t i = 0, o = 1; i <= rk && o < rk; i++) if (trk[i] != tcol[dd]) tr[o++] = trk[i];
          }
          for (int64_t i = 0; i < rk; i++) if (tr[i] >= 0 && dmap) tr[i] = dmap[tr[i]];
        }
        mdl.tree_from(top.data(), x0[0], matched0 == 1 && got0 > 0 ? tmp[0] : -1, tx, par);
      }
    }
    if (A > 0 && !is_tree) {
      // each row's width and lookup drafts first (its context alone decides them), then the heads its other
      // places need: draft i comes from head i + 1, so the call computes the heads up to the widest such place
      int64_t need = 0;
      for (int64_t a = 0; a < A; a++) {
        const int64_t r = act[a];
        int64_t matched = matched0;
        const int64_t got = got0 >= 0 ? got0 : mdl.lookup(id[r], nh, tmp.data(), &matched);
        const bool thin = narrow >= 1 && mdl.lookup_n > 0 && matched < 2;
        wid[r] = thin ? std::min(narrow, kb) : kb;   // narrow: the heads' first drafts only
        for (int64_t j = 0; j < nh; j++) {
          const bool lk = !thin && j < got;
          dr[r * nh + j] = lk ? tmp[j] : x0[r];      // (places past the width are fed, never accepted)
          qd[r * nh + j] = 1.0;
          look[r * nh + j] = lk ? 1 : 0;
          if (!lk && j < wid[r] - 1) need = std::max(need, j + 1);
        }
      }
      if (need > 0) {
        grow(hv, A * d);
        grow(ids, A * need);
        grow(lg, A * need * Vd);
        std::vector<int64_t> first(A);
        for (int64_t a = 0; a < A; a++) {
          std::memcpy(hv.data() + a * d, h.data() + hrow[act[a]] * d, d * sizeof(float));
          first[a] = x0[act[a]];                     // chained heads read the token drawn, not head 1's argmax
        }
        Tick tp2;
        mdl.propose(hv.data(), A, need, first.data(), ids.data(), lg.data());
        tp2.to(P_PROPOSE_PROJ);
        for (int64_t a = 0; a < A; a++) {
          const int64_t r = act[a];
          for (int64_t i = 0; i < std::min(need, wid[r] - 1); i++) {
            if (look[r * nh + i]) continue;
            double* qi = q.data() + ((size_t)r * nh + i) * Vd;
            const float* li = lg.data() + (a * need + i) * Vd;
            int64_t c;
            if (smp.match) {                         // head i + 2's choice at the place its draft goes
              c = smp.choose(li, Vd, dmap, id[r], pos0[id[r]] + cnt[id[r]] + i, qi);
            } else {
              smp.probs(li, Vd, qi);
              c = Sampler::pick(qi, Vd, smp.uniform(id[r]));
            }
            dr[r * nh + i] = dmap ? dmap[c] : c;
            qd[r * nh + i] = qi[c];
          }
        }
      }
    }
    if (g_prof) g_prof_steps += 1;
    for (int64_t r = 0; r < R;) {                    // finished rows leave: the last row takes each freed place
      if (!ended[r]) { r++; continue; }
      R -= 1;
      if (r == R) break;
      TORCH_CHECK(mdl.move_row(r, R, t + len[R]), "blockwise sampling: a cache whose rows cannot move");
      x0[r] = x0[R]; len[r] = len[R]; room[r] = room[R]; id[r] = id[R]; wid[r] = wid[R]; ended[r] = ended[R];
      std::copy(dr.begin() + R * nh, dr.begin() + (R + 1) * nh, dr.begin() + r * nh);
      std::copy(look.begin() + R * nh, look.begin() + (R + 1) * nh, look.begin() + r * nh);
      std::copy(qd.begin() + R * nh, qd.begin() + (R + 1) * nh, qd.begin() + r * nh);
      const size_t qn = (size_t)nh * Vd;
      std::copy(q.begin() + R * qn, q.begin() + (R + 1) * qn, q.begin() + r * qn);
    }
  }
  mdl.keep_logits = false;
  if (smp.match)
    for (int64_t r = 0; r < R0; r++) smp.rng[2 * r + 1] += cnt[r];   // each row's counter: the tokens it chose
  return {toks, torch::tensor(hist, lopt), torch::tensor(std::vector<int64_t>{s}, lopt),
          torch::empty({0}, torch::TensorOptions().dtype(torch::kFloat32)), torch::tensor(cnt, lopt),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()};
}
