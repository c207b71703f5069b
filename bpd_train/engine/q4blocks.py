"""A GGUF's 4-bit blocks in fp32 weights, and their packed layouts: q4_blocks finds Q4_0 / Q4_1 / Q4_K groups of 32
in a float32 matrix exactly (each weight == d * code + m, rounded once), q4_weight gives the q4 precision's form
(the file's blocks, or weights quantised to them at load), q4k_form a Q4_K tensor's own 6-bit scales; pack_q4 /
pack_q4q / pack_q4qk lay them out for csrc/kernels_q4.h and kernels_q4q.h."""

from __future__ import annotations

import torch
from torch import Tensor

Q4_GROUP = 32  # weights of a row per scale and offset (GGUF's Q4_0 / Q4_1 blocks; Q4_K's sub-blocks)


def _half_near(v: Tensor, step: int) -> Tensor:
    """v (>= 0) rounded to half precision, then `step` ulps up or down (a bit step is one ulp of a value >= 0):
    the candidates for a scale the file stored in half precision."""
    h = v.half()
    return (h.view(torch.int16) + step).clamp(min=0).view(torch.float16) if step else h


def q4_blocks(w: Tensor, halves: bool = True) -> tuple[Tensor, Tensor, Tensor] | None:
    """(codes [N,K] uint8 in 0..15, d [N,K/32], m [N,K/32]) with w == (d * codes) + m exactly, each product exact
    and each sum rounded once in float32 as gguf's dequantize computes them, or None where w [N,K] float32 is not
    such blocks (a GGUF's Q4_0, Q4_1 and Q4_K tensors are; trained weights are not). Q4_0 / Q4_1: a group's offset is
    its smallest weight (code 0), its scale the half-precision value nearest (range / top code) or a neighbour of it.
    Q4_K (a half-precision scale per 256 times a 6-bit one per 32, and a 6-bit offset): _float_scales. Either way a
    scale times a 4-bit code is exact in float32, so the kernels' fma(code, d, m) rounds once, as (d * code) + m does.
    halves=False: the float32 search alone."""
    n, k = w.shape
    if k % Q4_GROUP or w.numel() == 0 or w.dtype != torch.float32:
        return None
    if n > 8:  # most weights fail on their first rows: no pass over a large matrix
        first = q4_blocks(w[:8], halves)
        if first is None:
            return None
        halves = halves and bool((first[1].half().float() == first[1]).all())  # a K-quant's: no half-precision pass
        if n * k > _SLICE:  # a slice of rows at a time: the search's passes stay in cache
            rest = _by_rows(lambda r: q4_blocks(w[r], halves), 8, n, k)
            return None if rest is None else tuple(torch.cat(x) for x in zip(first, rest))  # type: ignore
    b = w.reshape(n, k // Q4_GROUP, Q4_GROUP)
    m = b.amin(-1)
    span = b.amax(-1) - m
    if not torch.isfinite(span).all():
        return None
    codes = torch.zeros(b.shape, dtype=torch.uint8)
    d = torch.zeros_like(m)
    todo = torch.ones(m.shape, dtype=torch.bool)
    for top in range(15, 0, -1) if halves else ():
        for step in (0, 1, -1):
            idx = todo.nonzero(as_tuple=True)
            if not idx[0].numel():
                return codes.view(n, k), d, m
            bb, mm = b[idx], m[idx].unsqueeze(-1)  # [G,32], [G,1]
            dh = _half_near(span[idx] / top, step)
            dd = dh.float().unsqueeze(-1)
            q = torch.where(dd > 0, ((bb - mm) / dd).round(), torch.zeros_like(bb)).clamp(0, 15)
            rec = dd * q + mm  # two roundings, as dequantize (no fused multiply-add in eager torch)
            # == takes -0.0 for 0.0 (Q4_0's zero codes times a negative scale): a zero weight's sign cannot change
            # an FMA chain that starts at +0 (it never holds -0), so the kernels' bits are the same
            ok = (rec == bb).all(-1)
            good = tuple(i[ok] for i in idx)
            codes[good] = q[ok].to(torch.uint8)
            d[good] = dd[ok].squeeze(-1)
            todo[good] = False
            if top == 15 and step == 0 and todo.float().mean() > 0.9:  # not half-precision scales (Q4_K): no more
                break
        if top == 15 and todo.float().mean() > 0.75:  # not half-precision scales (Q4_0 groups may lack the top code)
            break
    if todo.any() and not _float_scales(b, m, span, todo, codes, d):
        return None
    return codes.view(n, k), d, m


_SLICE = 1 << 20  # weights per slice of q4_blocks' search


def _by_rows(fn, r0: int, n: int, k: int):
    """fn over rows r0..n in slices of about _SLICE weights, its tuples of tensors joined; None where a slice's is."""
    parts = []
    for a in range(r0, n, max(8, _SLICE // k)):
        if (got := fn(slice(a, a + max(8, _SLICE // k)))) is None:
            return None
        parts.append(got)
    return tuple(torch.cat(x) for x in zip(*parts))


# float32 scale candidates: multiples of 16 ulps (a scale times a 4-bit code stays exact), nearest first, as far as a
# group whose weights sit far from zero needs (its range carries their rounding: up to about 300 times the range)
_SCALE_STEPS = tuple(s * 16 for i in range(25) for s in ((i, -i) if i else (0,)))
_OFFSET_STEPS = (0, 1, -1, 2, -2)


def _float_scales(b: Tensor, lo: Tensor, span: Tensor, todo: Tensor, codes: Tensor, d: Tensor) -> bool:
    """q4_blocks for the groups `todo` still holds, with float32 scales and offsets (Q4_K: d = d256 * sc and
    m = -dmin * mn, exact in float32; a group need not hold code 0). Most groups use codes 0 and 15 (llama.cpp's
    quantizer maps a group's extremes there); for the others a group's scale is about its smallest gap between two
    weights, so its codes span t = range / gap. The scale is then range / t on the grid of float32 values whose low 4
    bits are zero (times a 4-bit code: exact), the offset the middle of the interval every weight's rounding allows
    it, the lowest code c from 0 up; each candidate checked weight by weight. Fills codes, d and lo (the offsets) in
    place; False where a group matches none (or most groups miss the first try: not blocks)."""
    tops = torch.full(todo.shape, 15, dtype=torch.int64)

    def attempt(dt: int, ds: int, c: int) -> None:
        idx = (todo & (tops + dt >= 0) & (tops + dt + c <= 15)).nonzero(as_tuple=True)
        if not idx[0].numel():
            return
        bb, low = b[idx], lo[idx].unsqueeze(-1)  # [G,32], [G,1]
        t = (tops[idx] + dt).double()
        d0 = torch.where(t > 0, span[idx].double() / t.clamp(min=1), 0.0).float().view(torch.int32)
        dd = (((d0 + 8) & ~15) + ds).clamp(min=0).view(torch.float32).unsqueeze(-1)  # [G,1], low 4 bits 0
        q = torch.where(dd > 0, ((bb - low) / dd).round(), torch.zeros_like(bb))
        q = torch.minimum(q, t.float().unsqueeze(-1)).clamp(min=0) + c
        # each weight bounds the offset to within half its ulp of (weight - d * code): the middle of where all 32
        # bounds meet (an offset near zero beside large weights has many float32 values there)
        r = bb.double() - dd.double() * q.double()
        half = (torch.nextafter(bb.abs(), torch.tensor(float("inf"))) - bb.abs()).double() / 2
        m0 = (((r - half).amax(-1) + (r + half).amin(-1)) / 2).float().unsqueeze(-1).view(torch.int32)
        for ms in _OFFSET_STEPS:
            mm = (m0 + ms).view(torch.float32)
            ok = ((dd * q + mm) == bb).all(-1)  # dd * q exact: one rounding, as the kernels' FMA
            if not ok.any():
                continue
            good = tuple(i[ok] for i in idx)
            codes[good] = q[ok].to(torch.uint8)
            d[good] = dd[ok].squeeze(-1)
            lo[good] = mm[ok].squeeze(-1)
            todo[good] = False
            keep = ~ok
            idx = tuple(i[keep] for i in idx)
            if not idx[0].numel():
                return
            bb, q, dd, m0 = bb[keep], q[keep], dd[keep], m0[keep]

    attempt(0, 0, 0)
    if todo.float().mean() > 0.75:
        return False
    idx = todo.nonzero(as_tuple=True)
    srt = b[idx].sort(-1).values
    gap = srt[:, 1:] - srt[:, :-1]
    gap = torch.where(gap > 0, gap, torch.full_like(gap, float("inf"))).amin(-1)
    tops[idx] = torch.where(gap.isfinite(), (span[idx] / gap).round(), torch.zeros_like(gap)).clamp(0, 15).long()
    for dt in (0, -1, 1):
        for ds in _SCALE_STEPS:
            for c in range(16):
                if not todo.any():
                    return True
                attempt(dt, ds, c)
    return not todo.any()


def _padded(n: int, *vs: Tensor) -> tuple[Tensor, ...]:
    """Each [N, ...] tensor with zero rows added up to the packed layouts' whole blocks of 64 rows."""
    pad = -(-n // 64) * 64 - n
    return tuple(torch.cat([v, v.new_zeros(pad, *v.shape[1:])]) if pad else v for v in vs)


def _per_row(v: Tensor, per: int) -> Tensor:
    """[N, per] (N a multiple of 64) -> [blocks, 4 sub-blocks, per, 16 rows] as bytes: a value per row of a
    sub-block side by side, as every layout here holds scales and offsets."""
    return v.reshape(-1, 4, 16, per).permute(0, 1, 3, 2).contiguous().view(torch.uint8)


def _q4q_codes(codes: Tensor) -> Tensor:
    """[N, K] codes (N a multiple of 64) -> [blocks, 4, K/32, 256] bytes as the Q4Q kernels read a group: chunk t
    holds row n's codes of k = 4t..4t+3 in bytes 4n..4n+3, low nibbles, and of k = 16+4t..16+4t+3, high nibbles."""
    n, k = codes.shape
    c = codes.view(n // 64, 4, 16, k // Q4_GROUP, 2, 4, 4).permute(0, 1, 3, 4, 5, 2, 6)  # [.., g, half, t, rows, j]
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n // 64, 4, k // Q4_GROUP, 256)


def pack_q4(codes: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """The Q4F kernels' layout (csrc/kernels_q4.h) of q4_blocks' output: per block of 64 rows (zero-padded), 4
    sub-blocks of 16 rows, per group of 32 k: d[16], m[16] (float32 bytes), then 32 x 8 code bytes (row j's code in
    byte j's low nibble, row j + 8's in its high one)."""
    g = codes.shape[1] // Q4_GROUP
    codes, d, m = _padded(codes.shape[0], codes, d, m)
    c = codes.view(-1, 4, 16, g, Q4_GROUP).permute(0, 1, 3, 4, 2)  # [blocks, 4, g, 32, 16 rows]
    nib = (c[..., :8] | (c[..., 8:] << 4)).reshape(-1, 4, g, 256)  # [blocks, 4, g, 32 x 8]
    return torch.cat([_per_row(d, g), _per_row(m, g), nib], -1).reshape(-1).contiguous()


def q4_weight(w: Tensor, quantize: bool = True) -> tuple[Tensor, Tensor, Tensor, bool] | None:
    """The "q4" form of w [N, K] float32 (K a multiple of 32): (codes [N,K] uint8 in 0..15, d [N,K/32] float16,
    m [N,K/32] float16, from_blocks); weight = d * code + m. from_blocks: w is 4-bit blocks (a GGUF's Q4_0 / Q4_1
    tensors, q4_blocks) and every d and m is a half-precision value, so the form holds the file's weights exactly
    (Q4_0's d (q - 8) as the file has it: offset -8 d, where the group's smallest weight need not be a half); where
    the blocks' d and m are not half-precision values (Q4_K: a half-precision scale per 256 times a 6-bit one), d and
    m are float32 (the kernels' Q4QF layout).
    Otherwise the weights are quantised here as gguf's Q4_1 does (per 32: the
    offset the group's minimum, the scale its range / 15, both rounded to half precision, codes rounded to the
    nearest step from them); quantize=False: None instead. None where a weight is not finite or beyond half
    precision's range."""
    n, k = w.shape
    if k % Q4_GROUP or w.numel() == 0 or w.dtype != torch.float32:
        return None
    g = k // Q4_GROUP
    blocks = q4_blocks(w)
    if blocks is not None:
        codes, d, m = blocks
        exact = (codes, d, m)
        codes = codes.view(n, g, Q4_GROUP)
        bad = m.half().float() != m
        if bad.any():  # Q4_0: d (q - 8), whose smallest weight (q4_blocks' offset) need not be a half: offset -8 d
            r = torch.where(d > 0, m / d, torch.zeros_like(m)).round()
            c = codes.int()
            up = c + (r + 8).int().unsqueeze(-1)  # scale d, offset -8 d
            down = (8 - r).int().unsqueeze(-1) - c  # scale -d, offset 8 d (the group's largest weight is d * 8)
            ok = bad & (d * r == m)
            use_up = ok & (up.amin(-1) >= 0) & (up.amax(-1) <= 15)
            use_down = ok & ~use_up & (down.amin(-1) >= 0) & (down.amax(-1) <= 15)
            codes = torch.where(use_up.unsqueeze(-1), up, torch.where(use_down.unsqueeze(-1), down, c)).to(torch.uint8)
            m = torch.where(use_up, -8 * d, torch.where(use_down, 8 * d, m))
            d = torch.where(use_down, -d, d)
        dh, mh = d.half(), m.half()
        if bool((dh.float() == d).all() and (mh.float() == m).all()):
            return codes.view(n, k), dh, mh, True
        return (*exact, True)  # float32 scales and offsets: the blocks as q4_blocks found them
    if not quantize:
        return None
    b = w.reshape(n, g, Q4_GROUP)
    lo, hi = b.amin(-1), b.amax(-1)
    dh, mh = ((hi - lo) / 15).half(), lo.half()
    if not (torch.isfinite(dh).all() and torch.isfinite(mh).all()):
        return None
    dd, mm = dh.float().unsqueeze(-1), mh.float().unsqueeze(-1)
    q = torch.where(dd > 0, ((b - mm) / dd).round(), torch.zeros_like(b)).clamp(0, 15)
    return q.to(torch.uint8).view(n, k), dh, mh, False


def _six_bit(v: Tensor) -> tuple[Tensor, Tensor] | None:
    """v [N, G] >= 0 (G a multiple of 8) as a half-precision value per 8 groups times a 6-bit integer per group
    (Q4_K's scales): (s [N, G/8] float16, q [N, G] uint8) with s * q == v exactly, or None."""
    n, g = v.shape
    vb = v.view(n, g // 8, 8)
    top_v = vb.amax(-1)
    s, q = torch.zeros(n, g // 8), torch.zeros(vb.shape)
    todo = top_v > 0
    for top in range(63, 0, -1):
        for step in (0, 1, -1):
            idx = todo.nonzero(as_tuple=True)
            if not idx[0].numel():
                return s.half(), q.to(torch.uint8).view(n, g)
            c = _half_near(top_v[idx] / top, step)
            c = c.float().unsqueeze(-1)
            qq = torch.where(c > 0, (vb[idx] / c).round(), torch.zeros_like(vb[idx])).clamp(0, 63)
            ok = (c * qq == vb[idx]).all(-1)  # c * qq exact: 11 bits times 6
            good = tuple(i[ok] for i in idx)
            s[good], q[good], todo[good] = c[ok].squeeze(-1), qq[ok], False
    return None if todo.any() else (s.half(), q.to(torch.uint8).view(n, g))


def _six_bit_offsets(w: Tensor, q: Tensor, d: Tensor, mid: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """Q4_K's offsets for the groups w [N, G, 32] with codes q and scales d (float32 [N, G]): a half-precision dmin
    per 8 groups times a 6-bit mn per group, with each group's codes shifted up by c (0..15 - its top code: where
    q4_blocks gave code 0 to a weight the file coded higher), such that every weight == d * (q + c) - dmin * mn
    rounded once: (dmin [N, G/8] float16, mn [N, G] uint8, c [N, G] uint8), or None. mid: each group's offset
    magnitude as found (its middle), which places dmin: the groups that use code 15 cannot shift, so the largest
    of their offsets is dmin times the largest mn (63 in llama.cpp's files, else lower)."""
    n, g, _ = w.shape
    sh = (n, g // 8, 8)
    w4, q4, d4 = w.view(*sh, 32), q.view(*sh, 32), d.view(*sh, 1)
    room = (15 - q.amax(-1)).view(sh)
    mid3 = mid.view(sh)  # (below zero where the group's codes start lower than the file's)
    fixed = room == 0
    top_v = torch.where(fixed.any(-1), torch.where(fixed, mid3, 0.0).amax(-1), mid3.amax(-1)).clamp(min=0)
    dmin, mn, shift = torch.zeros(n, g // 8), torch.zeros(sh), torch.zeros(sh)
    todo = torch.ones(n, g // 8, dtype=torch.bool)
    for top in [0] + list(range(63, 0, -1)):
        for step in (0, 1, -1) if top else (0,):
            idx = todo.nonzero(as_tuple=True)
            if not idx[0].numel():
                return dmin.half(), mn.to(torch.uint8).view(n, g), shift.to(torch.uint8).view(n, g)
            c = _half_near(top_v[idx] / top, step) if top else torch.zeros(len(idx[0]), dtype=torch.float16)
            c = c.float().view(-1, 1, 1)  # [B, 1, 1]
            ww, qq, dd, mm, rr = w4[idx], q4[idx], d4[idx], mid3[idx].unsqueeze(-1), room[idx]
            got, kk = torch.full(rr.shape, -1.0), torch.zeros(rr.shape)
            for s in range(16):
                # the super-blocks where a group may still fit at this shift, and none is out of shifts
                left = got < 0
                live = (left & (rr >= s)).any(-1) & ~(left & (rr < s)).any(-1)
                sel = live.nonzero(as_tuple=True)[0]
                if not sel.numel():
                    break
                cs, ms_, ds_ = c[sel], mm[sel], dd[sel]
                k = torch.where(cs > 0, ((ms_ + ds_ * s) / cs).round(), torch.zeros_like(ms_)).clamp(0, 63)
                fit = ((ds_ * (qq[sel] + s) - cs * k) == ww[sel]).all(-1)  # products exact: one rounding
                fit &= (s <= rr[sel]) & left[sel]
                got[sel] = torch.where(fit, float(s), got[sel])
                kk[sel] = torch.where(fit, k.squeeze(-1), kk[sel])
            ok = (got >= 0).all(-1)
            good = tuple(i[ok] for i in idx)
            dmin[good], mn[good], shift[good] = c.view(-1)[ok], kk[ok], got[ok]
            todo[good] = False
    return None if todo.any() else (dmin.half(), mn.to(torch.uint8).view(n, g), shift.to(torch.uint8).view(n, g))


def q4k_form(w: Tensor, codes: Tensor, d: Tensor, m: Tensor):
    """Q4_K's own form of q4_blocks' float32-scale blocks of w [N, K] (K a multiple of 256): (codes [N, K] uint8,
    d256 [N, K/256] and dmin256 float16, sc [N, K/32] and mn uint8 in 0..63) with every weight == (d256 * sc) * code
    - dmin256 * mn, rounded once; or None (the blocks then keep a float32 d and m per 32). q4_blocks' offset rebuilds
    its group but need not be the file's (nor its lowest code the file's), so the offsets are searched as dmin256 *
    mn with each group's codes shifted up as its weights allow (_six_bit_offsets); a slice of rows at a time, the
    result checked weight by weight."""
    n, k = w.shape
    if k % 256 or d.dtype != torch.float32 or bool((d < 0).any()):
        return None
    if n * k > _SLICE and n > 8:
        return _by_rows(lambda r: q4k_form(w[r], codes[r], d[r], m[r]), 0, n, k)
    g = k // Q4_GROUP
    ds = _six_bit(d)
    if ds is None:
        return None
    b, q = w.view(n, g, Q4_GROUP), codes.view(n, g, Q4_GROUP).float()
    ms = _six_bit_offsets(b, q, d, -m)
    if ms is None:
        return None
    (d256, sc), (m256, mn, shift) = ds, ms
    q = q + shift.unsqueeze(-1).float()
    dd = (d256.float().repeat_interleave(8, 1) * sc.float()).unsqueeze(-1)
    mm = -(m256.float().repeat_interleave(8, 1) * mn.float()).unsqueeze(-1)
    if not torch.equal((dd * q + mm).view(n, k), w):
        return None
    return q.to(torch.uint8).view(n, k), d256, sc, m256, mn


def pack_q4q(codes: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """The Q4Q kernels' layout (csrc/kernels_q4q.h) of q4_weight's form: per block of 64 rows (zero-padded), 4
    sub-blocks of 16 rows, per group of 32 k: d[16], m[16] (float16 bytes; float32 where d and m are: mode Q4QF),
    then the group's codes (_q4q_codes)."""
    g = codes.shape[1] // Q4_GROUP
    codes, d, m = _padded(codes.shape[0], codes, d, m)
    return torch.cat([_per_row(d, g), _per_row(m, g), _q4q_codes(codes)], -1).reshape(-1).contiguous()


def pack_q4qk(codes: Tensor, d256: Tensor, sc: Tensor, m256: Tensor, mn: Tensor) -> Tensor:
    """The Q4QK layout (csrc/kernels_q4q.h) of q4k_form's output: per block of 64 rows (zero-padded), 4 sub-blocks
    of 16 rows, per 256 k: d256[16], dmin256[16] (float16 bytes), then per group of 32 k: sc[16], mn[16] (bytes) and
    the codes as pack_q4q lays them (0.578 bytes a weight)."""
    g, s = codes.shape[1] // Q4_GROUP, codes.shape[1] // 256
    codes, d256, sc, m256, mn = _padded(codes.shape[0], codes, d256, sc, m256, mn)
    nb = codes.shape[0] // 64
    sm = [_per_row(v, g).view(nb, 4, s, 8, 16) for v in (sc, mn)]
    groups = torch.cat([*sm, _q4q_codes(codes).view(nb, 4, s, 8, 256)], -1)
    head = torch.cat([_per_row(d256, s), _per_row(m256, s)], -1)  # [blocks, 4, s, 64]
    return torch.cat([head, groups.reshape(nb, 4, s, 8 * 288)], -1).reshape(-1).contiguous()
