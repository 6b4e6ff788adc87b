"""Sampling kernel: one program per row, streaming the row in BLOCK_V chunks (it never fits in registers).

The common rows read the logits twice:
  pass 1   the argmax and max logit, each lane's own maximum, and (where the row needs the total mass Z)
           each lane's online softmax sum. A greedy row ends here.
  bound    a lower bound L of the final threshold, from registers only:
             top-k (0 < k <= BLOCK_V): the k-th largest maximum of GROUPS lane groups (of the lanes for
               k > GROUPS): k groups each hold a logit >= it, so the k-th largest logit is >= it;
             top-p without top-k: the largest key at or above which the lanes' maxima and masses prove
               p * Z of mass (_mass_bound), so the top-p threshold is >= it;
             min-p: m + log(min_p), less a rounding margin.
  pass 2   the tokens with s >= L are compacted, in vocabulary order, into the row's CAP slots of the
           launch's candidate buffers (value and index).
  finish   over the candidates in registers: the exact top-k threshold and top-p threshold (radix selects
           over the candidates' keys), min-p, and the inverse-CDF draw in vocabulary order.
Rows with no filter (temperature only) take pass 1 with Z and one streaming draw. Where more than CAP
tokens reach L (flat logits, large k, a top-p set wider than CAP), or k > BLOCK_V, the row falls back to
thresholds found by a radix-4 search streaming the row, 16 passes for each, correct for any input. The
top-k bound compares the tokens' own scaled values (no rounding to slip); the min-p bound keeps a margin
far above the rounding of exp and log; the top-p bound may slip by rounding, so the finish checks that the
top-p threshold lies among the candidates and the row falls back where it does not.

Thresholds compare order-preserving int32 keys of the scaled logits (as int64, so a prefix plus a digit
never overflows); -0.0 takes +0.0's key, since the reference compares the floats.
"""
import triton
import triton.language as tl

KEY_MIN = tl.constexpr(-2147483648)       # the smallest key: no threshold
BELOW_ALL = tl.constexpr(-2147483649)     # an empty candidate slot's key: below any threshold


@triton.jit
def _order_key(x):
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _scaled(row_ptr, offs, temperature, VOCAB: tl.constexpr):
    x = tl.load(row_ptr + offs, mask=offs < VOCAB, other=float("-inf")).to(tl.float32)
    return x / temperature


@triton.jit
def _select(keys, weights, target, STEPS: tl.constexpr):
    """Over register values: the largest key t (to 2 * STEPS high bits; fewer bits give a t at or below
    the exact one) with sum(weights of keys >= t) >= target."""
    digits = tl.arange(0, 4).to(tl.int64)
    prefix = tl.full([], KEY_MIN, tl.int64)
    for p in tl.static_range(STEPS):
        shift = 30 - 2 * p
        cands = prefix + (digits << shift)
        total = tl.sum(tl.where(keys[:, None] >= cands[None, :], weights[:, None], 0.0), axis=0)
        best = tl.max(tl.where(total >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def _key_value(key):
    """The float whose _order_key is key (the key's bit map is its own inverse)."""
    k32 = key.to(tl.int32)
    return (k32 ^ ((k32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _mass_bound(lane_keys, lane_s, lane_z, m, target, PER_LANE: tl.constexpr):
    """A key t at or below the top-p threshold, from pass 1's lanes: lane j (maximum s_j, mass Z_j over at
    most PER_LANE tokens) holds, at or above t <= s_j, at least max(exp(s_j - m), Z_j - (PER_LANE - 1)
    exp(t - m)), since its other tokens below t hold less than exp(t - m) each. The largest t (to 16 bits)
    where these lower bounds sum to target leaves at least target of mass at or above t in the row."""
    top = tl.where(lane_s == float("-inf"), 0.0, tl.exp(lane_s - m))
    mass = tl.where(lane_s == float("-inf"), 0.0, lane_z * top)
    digits = tl.arange(0, 4).to(tl.int64)
    prefix = tl.full([], KEY_MIN, tl.int64)
    for p in tl.static_range(8):
        shift = 30 - 2 * p
        cands = prefix + (digits << shift)
        room = (PER_LANE - 1) * tl.exp(tl.minimum(_key_value(cands) - m, 80.0))
        held = tl.maximum(top[:, None], mass[:, None] - room[None, :])
        total = tl.sum(tl.where(lane_keys[:, None] >= cands[None, :], held, 0.0), axis=0)
        best = tl.max(tl.where(total >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def _radix_search(row_ptr, temperature, m, floor_key, target, USE_MASS: tl.constexpr,
                  VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    """Largest key t with F(t) >= target, F(t) = count (or exp mass) of tokens with key >= max(t, floor),
    streaming the row 16 times (the fallback)."""
    digits = tl.arange(0, 4).to(tl.int64)
    prefix = tl.full([], KEY_MIN, tl.int64)
    for p in range(16):
        shift = 30 - 2 * p
        cands = prefix + (digits << shift)
        acc = tl.zeros([BLOCK_V, 4], tl.float32)
        for start in range(0, VOCAB, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            s = _scaled(row_ptr, offs, temperature, VOCAB)
            key = _order_key(s)
            ok = (offs < VOCAB) & (key >= floor_key)
            ge = (key[:, None] >= cands[None, :]) & ok[:, None]
            if USE_MASS:
                acc += tl.where(ge, tl.exp(s - m)[:, None], 0.0)
            else:
                acc += ge.to(tl.float32)
        total = tl.sum(acc, axis=0)
        best = tl.max(tl.where(total >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def _kept_mass(row_ptr, t, m, floor_key, min_p, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    z = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        e = tl.exp(s - m)
        keep = (offs < VOCAB) & (_order_key(s) >= floor_key) & (e >= min_p)
        z += tl.where(keep, e, 0.0)
    return tl.sum(z, axis=0)


@triton.jit
def _draw_stream(row_ptr, t, m, floor_key, min_p, target, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inverse CDF in vocabulary order over the row: the chunk where the running kept mass passes target,
    then the token inside it (the last kept token where rounding leaves target unreached)."""
    running = tl.zeros([], tl.float32)
    before = tl.zeros([], tl.float32)
    cross = tl.full([], -1, tl.int32)
    lane_last = tl.full([BLOCK_V], -1, tl.int32)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        e = tl.exp(s - m)
        keep = (offs < VOCAB) & (_order_key(s) >= floor_key) & (e >= min_p)
        chunk = tl.sum(tl.where(keep, e, 0.0), axis=0)
        hit = (cross < 0) & (running + chunk > target)
        cross = tl.where(hit, start, cross)
        before = tl.where(hit, running, before)
        running += chunk
        lane_last = tl.maximum(lane_last, tl.where(keep, offs, -1))
    chosen = tl.max(lane_last, axis=0)
    if cross >= 0:
        offs = cross + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        e = tl.exp(s - m)
        keep = (offs < VOCAB) & (_order_key(s) >= floor_key) & (e >= min_p)
        cum = tl.cumsum(tl.where(keep, e, 0.0), axis=0) + before
        first = tl.min(tl.where(keep & (cum > target), offs, VOCAB), axis=0)
        last_in_chunk = tl.max(tl.where(keep, offs, -1), axis=0)
        chosen = tl.where(first < VOCAB, first, last_in_chunk)
    return chosen


@triton.jit
def _compact(row_ptr, t, bound_key, val_ptr, idx_ptr, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr,
             CAP: tl.constexpr):
    """Stores the tokens with key >= bound_key (scaled value, index) in vocabulary order, the first CAP of
    them; returns how many there are (more than CAP: the candidates are incomplete)."""
    count = tl.zeros([], tl.int32)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        take = (offs < VOCAB) & (_order_key(s) >= bound_key)
        n = tl.sum(take.to(tl.int32), axis=0)
        if n > 0:       # a chunk without candidates skips the scan
            pos = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
            ok = take & (pos < CAP)
            tl.store(val_ptr + pos, s, mask=ok)
            tl.store(idx_ptr + pos, offs, mask=ok)
        count += n
    return count


@triton.jit
def _finish(val_ptr, idx_ptr, count, m, k, use_k, top_p, min_p, z_row, p_may_fall_below, u,
            VOCAB: tl.constexpr, N: tl.constexpr):
    """The token drawn from the candidates (all tokens >= the bound, in vocabulary order, count <= N);
    -1 where the top-p threshold falls below the bound and min-p does not cover it (only rounding in the
    bound can do that; the caller falls back)."""
    c = tl.arange(0, N)
    valid = c < count
    cs = tl.load(val_ptr + c, mask=valid, other=float("-inf"))
    ci = tl.load(idx_ptr + c, mask=valid, other=VOCAB)
    ckey = tl.where(valid, _order_key(cs), BELOW_ALL)
    e = tl.where(valid, tl.exp(cs - m), 0.0)
    floor_key = tl.full([], KEY_MIN, tl.int64)
    if use_k:
        floor_key = _select(ckey, valid.to(tl.float32), k.to(tl.float32), 16)
    ok = tl.full([], 1, tl.int32)
    if top_p < 1.0:
        mass = tl.where(ckey >= floor_key, e, 0.0)
        have = tl.sum(mass, axis=0)
        target = top_p * tl.where(use_k, have, z_row)
        if have >= target:
            tp = tl.minimum(_select(ckey, mass, target, 16), _order_key(m))   # the max token always stays
            floor_key = tl.maximum(floor_key, tp)
        else:
            ok = tl.where(p_may_fall_below, 0, 1)
    kept = (ckey >= floor_key) & (e >= min_p)
    w = tl.where(kept, e, 0.0)
    cum = tl.cumsum(w, axis=0)
    target = u * tl.sum(w, axis=0)
    first = tl.min(tl.where(kept & (cum > target), ci, VOCAB), axis=0)
    last = tl.max(tl.where(kept, ci, -1), axis=0)
    chosen = tl.where(first < VOCAB, first, last)
    return tl.where(ok != 0, chosen, -1)


@triton.jit
def sample_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniform_ptr, min_p_ptr, out_ptr,
                  cand_val_ptr, cand_idx_ptr,
                  VOCAB: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, GROUPS: tl.constexpr,
                  SMALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * VOCAB
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    t = tl.where(greedy, 1.0, temperature)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    use_k = (k > 0) & (k < VOCAB)
    use_p = top_p < 1.0
    use_min = min_p > 0.0
    # Z from pass 1: for the top-p bound without top-k, and for the draw of a row with no filter
    need_z = (~greedy) & (~use_k) & (use_p | (~use_min))

    # Pass 1: argmax (first index on ties; each lane keeps its earliest maximum), each lane's max logit
    # and, where needed, each lane's mass sum(exp((x - lane max) / t)), one exp a token.
    lane_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    lane_z = tl.zeros([BLOCK_V], tl.float32)
    if need_z:
        for start in range(0, VOCAB, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < VOCAB, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)     # NaN counts as the maximum (kernels/argmax says why)
            take = x > lane_best
            e = tl.exp((tl.minimum(x, lane_best) - tl.maximum(x, lane_best)) / t)
            e = tl.where(x == float("-inf"), 0.0, e)
            lane_z = tl.where(take, lane_z * e + 1.0, lane_z + e)
            lane_idx = tl.where(take, offs, lane_idx)
            lane_best = tl.where(take, x, lane_best)
    else:
        for start in range(0, VOCAB, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < VOCAB, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)
            take = x > lane_best
            lane_idx = tl.where(take, offs, lane_idx)
            lane_best = tl.where(take, x, lane_best)
    best_val = tl.max(lane_best, axis=0)
    best_idx = tl.min(tl.where(lane_best == best_val, lane_idx, VOCAB), axis=0)
    # NaN or +inf logits (or none above -inf) leave no distribution to draw from: such a row takes its
    # argmax, a valid id (an id outside the vocabulary would stop the engine at the next embedding gather)
    if greedy | (best_val == float("inf")) | (best_val == float("-inf")):
        tl.store(out_ptr + row, best_idx.to(tl.int64))
        return
    m = best_val / t    # the max scaled logit (the max token's own scaled value)
    z_row = tl.sum(tl.where(lane_best == float("-inf"), 0.0, lane_z * tl.exp((lane_best - best_val) / t)), axis=0)
    u = tl.load(uniform_ptr + row)

    # The bound L (a key) below which no token can be kept, where one is known without reading the row.
    # Group maxima are tokens of the row: the k-th largest of them is at or below the k-th largest token.
    margin = 1e-3 + tl.abs(m) * 1e-6     # in scaled-logit units: rounding of exp, log and the division
    min_key = _order_key(m + tl.log(tl.maximum(min_p, 1e-30)) - margin)
    lane_keys = _order_key(lane_best / t)
    group_best = tl.max(tl.reshape(lane_best, [GROUPS, BLOCK_V // GROUPS]), axis=1) / t
    group_keys = _order_key(group_best)
    bound_key = tl.full([], KEY_MIN, tl.int64)
    p_key = tl.full([], KEY_MIN, tl.int64)
    if use_k:
        if k <= GROUPS:
            bound_key = _select(group_keys, tl.full([GROUPS], 1.0, tl.float32), k.to(tl.float32), 8)
        elif k <= BLOCK_V:
            bound_key = _select(lane_keys, tl.full([BLOCK_V], 1.0, tl.float32), k.to(tl.float32), 8)
    elif use_p:
        p_key = _mass_bound(lane_keys, lane_best / t, lane_z, m, top_p * z_row * (1.0 + 1e-5),
                            (VOCAB + BLOCK_V - 1) // BLOCK_V)
        bound_key = tl.where(use_min, tl.maximum(p_key, min_key), p_key)
    elif use_min:
        bound_key = min_key
    candidates = (use_k & (k <= BLOCK_V)) | ((~use_k) & (use_p | use_min))
    p_may_fall_below = (~use_min) | (p_key >= min_key)

    chosen = tl.full([], -1, tl.int32)
    if candidates:
        val_ptr = cand_val_ptr + row * CAP
        idx_ptr = cand_idx_ptr + row * CAP
        count = _compact(row_ptr, t, bound_key, val_ptr, idx_ptr, VOCAB, BLOCK_V, CAP)
        tl.debug_barrier()      # the candidates other threads stored are read below
        if count <= SMALL:
            chosen = _finish(val_ptr, idx_ptr, count, m, k, use_k, top_p, min_p, z_row, p_may_fall_below, u,
                             VOCAB, SMALL)
        elif count <= CAP:
            chosen = _finish(val_ptr, idx_ptr, count, m, k, use_k, top_p, min_p, z_row, p_may_fall_below, u,
                             VOCAB, CAP)
    if chosen < 0:
        if need_z & (~use_p):     # temperature only: Z is pass 1's
            chosen = _draw_stream(row_ptr, t, m, KEY_MIN, 0.0, u * z_row, VOCAB, BLOCK_V)
        else:
            floor_key = tl.full([], KEY_MIN, tl.int64)
            if use_k:
                floor_key = _radix_search(row_ptr, t, m, floor_key, k.to(tl.float32), False, VOCAB, BLOCK_V)
            if use_p:
                z = z_row      # without top-k, pass 1's
                if use_k:
                    z = _kept_mass(row_ptr, t, m, floor_key, 0.0, VOCAB, BLOCK_V)
                tp = _radix_search(row_ptr, t, m, floor_key, top_p * z, True, VOCAB, BLOCK_V)
                floor_key = tl.minimum(tp, _order_key(m))
            target = u * _kept_mass(row_ptr, t, m, floor_key, min_p, VOCAB, BLOCK_V)
            chosen = _draw_stream(row_ptr, t, m, floor_key, min_p, target, VOCAB, BLOCK_V)
    tl.store(out_ptr + row, chosen.to(tl.int64))
