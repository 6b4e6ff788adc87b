"""Sampling kernels: each row is cut into SPLITS slices of CHUNK tokens so that a row's reads spread over many
programs (one program streaming a 128k-entry row is latency-bound: ~0.1 ms whatever the batch). Four launches:

  stats    grid (rows, SPLITS): each slice's maximum and first index of it, the maxima of its GROUPS lane
           groups and, where the row needs the total mass Z, the slice's and each group's mass.
  bound    grid (rows,): the row's argmax (a greedy row ends here), m = max s, Z, and a lower bound L of the
           final threshold from the groups alone:
             top-k (k <= NGROUPS): the k-th largest group maximum (k groups each hold a token >= it);
             top-p without top-k: the largest key at or above which the groups' maxima and masses prove
               p * Z of mass (thresholds.mass_bound);
             min-p: m + log(min_p), less a rounding margin.
           A row with no filter (temperature only) draws here: the slice where the running mass passes
           u * Z from the slices' masses, then the token inside that slice.
  compact  grid (rows, SPLITS): each slice stores its tokens with s >= L, in vocabulary order, into its CAP_S
           candidate slots, and how many there are.
  finish   grid (rows,): the slices' candidates gathered in vocabulary order into registers (SMALL of them
           where they fit, else all NCAND), then the exact top-k and top-p thresholds, min-p, and the
           inverse-CDF draw in vocabulary order. The thresholds of at most SMALL candidates come from their
           ranks, each candidate's count and mass of candidates at or above it (the candidates streamed
           PAIRWISE a loop step past all of them at once, no reduction until the thresholds are read off);
           those of more from radix selects over the keys, a dependent reduction for every RADIX bits. Both
           give the same keys.
Where a slice holds more than CAP_S tokens >= L (flat logits, large k, a wide top-p set), or k > NGROUPS, the
finish falls back to thresholds found by a radix-4 search streaming the whole row, 16 passes for each, correct
for any input. The top-k bound compares the tokens' own scaled values (no rounding to slip); the min-p bound
keeps a margin far above the rounding of exp and log; the top-p bound may slip by rounding, so the finish
checks that the top-p threshold lies among the candidates and falls back where it does not.

Thresholds are order keys of the scaled logits; thresholds.py holds the keys, the radix selects over
registers, the ranks, and the fallback's searches streaming the row.

The launches share two per-row workspaces (layouts in __init__.py): float32 fws [FROW] and int32 iws [IROW].
"""
import triton
import triton.language as tl

from engc.kernels import pdl
from engc.kernels.sampling import thresholds

DONE = tl.constexpr(0)                    # a row's mode after bound: its token is out already
CANDIDATES = tl.constexpr(1)              # compact its slices, then finish from the candidates
FALLBACK = tl.constexpr(2)                # finish by streaming radix searches over the row


@triton.jit
def _row_workspace(fws_ptr, iws_ptr, row, SPLITS: tl.constexpr, NGROUPS: tl.constexpr, NCAND: tl.constexpr):
    """Where the row's float32 and int32 workspaces start (their layouts: __init__.row_sizes)."""
    return (fws_ptr + row * (2 * SPLITS + 2 * NGROUPS + NCAND + 2), iws_ptr + row * (2 * SPLITS + NCAND + 3))


@triton.jit
def _row_params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, VOCAB: tl.constexpr):
    """(t, greedy, k, use_k, top_p, use_p, min_p, use_min, need_z): need_z where the row needs Z (the top-p
    bound without top-k, or the draw of a row with no filter)."""
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    t = tl.where(greedy, 1.0, temperature)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    use_k = (k > 0) & (k < VOCAB)
    use_p = top_p < 1.0
    use_min = min_p > 0.0
    need_z = (~greedy) & (~use_k) & (use_p | (~use_min))
    return t, greedy, k, use_k, top_p, use_p, min_p, use_min, need_z


@triton.jit
def _gather(val_ptr, idx_ptr, counts, total, VOCAB: tl.constexpr, SPLITS: tl.constexpr, CAP_S: tl.constexpr,
            N: tl.constexpr):
    """The first N candidates in vocabulary order (slice by slice, each slice's in order): values, indices,
    validity (total <= N of them are real)."""
    c = tl.arange(0, N)
    incl = tl.cumsum(counts, axis=0)
    slice_of = tl.sum((incl[None, :] <= c[:, None]).to(tl.int32), axis=1)
    first = tl.sum(tl.where(tl.arange(0, SPLITS)[None, :] == slice_of[:, None], (incl - counts)[None, :], 0),
                   axis=1)
    valid = c < total
    src = slice_of * CAP_S + c - first
    cs = tl.load(val_ptr + src, mask=valid, other=float("-inf"))
    ci = tl.load(idx_ptr + src, mask=valid, other=VOCAB)
    return cs, ci, valid


@triton.jit
def _finish(cs, ci, valid, total, m, k, use_k, top_p, min_p, z_row, p_may_fall_below, u, key_ptr, weight_ptr,
            VOCAB: tl.constexpr, RADIX: tl.constexpr, PAIRWISE: tl.constexpr):
    """(token, floor key, ranked) drawn from the candidates (cs, ci where valid, the first total: all tokens
    >= the bound, in vocabulary order); token -1 where the top-p threshold falls below the bound and min-p
    does not cover it (only rounding in the bound can do that; the caller falls back).

    PAIRWISE 0: the thresholds from radix selects, 32 / RADIX dependent reductions each. PAIRWISE n: from
    each candidate's rank, its count and mass of candidates at or above it (thresholds.ranks, the
    candidates copied to key_ptr and weight_ptr and streamed n a step). Both give the same keys: top-k's
    counts are exact, and a top-p key stands where the select's own sums confirm it (thresholds.is_select),
    else the select runs (ranked 0 then; rounding alone leads there).
    """
    ckey = tl.where(valid, thresholds.order_key(cs), thresholds.BELOW_ALL)
    e = tl.where(valid, tl.exp(cs - m), 0.0)
    floor_key = tl.full([], thresholds.KEY_MIN, tl.int64)
    ranked = tl.full([], 1, tl.int32)
    if PAIRWISE:
        # int32 keys, KEY_MIN in an empty slot: no candidate has that key (it is a NaN's, and a row with a
        # NaN is drawn by its argmax), so an empty slot is never counted above a candidate and, picked, gives
        # no threshold
        keys32 = tl.where(valid, ckey, thresholds.KEY_MIN).to(tl.int32)
        c = tl.arange(0, cs.shape[0])
        tl.store(key_ptr + c, keys32.to(tl.float32, bitcast=True))
        tl.store(weight_ptr + c, e)
        tl.debug_barrier()      # every thread's copy written before any thread reads the others'
        # a candidate's mass sums every candidate at or above it: at or above the top-k threshold, that is
        # the mass the select would sum there, so one pass serves both thresholds
        at_least, held = thresholds.ranks(keys32, key_ptr, weight_ptr,
                                          tl.where(use_k | (top_p < 1.0), total, 0), PAIRWISE)
    if use_k:
        if PAIRWISE:
            floor_key = tl.max(tl.where(at_least >= k, keys32, thresholds.KEY_MIN), axis=0).to(tl.int64)
        else:
            floor_key = thresholds.select(ckey, valid.to(tl.float32), k.to(tl.float32), 32, RADIX)
    ok = tl.full([], 1, tl.int32)
    if top_p < 1.0:
        mass = tl.where(ckey >= floor_key, e, 0.0)
        have = tl.sum(mass, axis=0)
        target = top_p * tl.where(use_k, have, z_row)
        if have >= target:
            if PAIRWISE:
                tp = tl.max(tl.where((keys32 >= floor_key) & (held >= target), keys32, thresholds.KEY_MIN),
                            axis=0).to(tl.int64)
                if not thresholds.is_select(ckey, mass, target, tp, RADIX):
                    tp = thresholds.select(ckey, mass, target, 32, RADIX)
                    ranked = tl.full([], 0, tl.int32)
            else:
                tp = thresholds.select(ckey, mass, target, 32, RADIX)
            # the max token always stays
            floor_key = tl.maximum(floor_key, tl.minimum(tp, thresholds.order_key(m)))
        else:
            ok = tl.where(p_may_fall_below, 0, 1)
    kept = (ckey >= floor_key) & (e >= min_p)
    w = tl.where(kept, e, 0.0)
    cum = tl.cumsum(w, axis=0)
    target = u * tl.sum(w, axis=0)
    first = tl.min(tl.where(kept & (cum > target), ci, VOCAB), axis=0)
    last = tl.max(tl.where(kept, ci, -1), axis=0)
    chosen = tl.where(first < VOCAB, first, last)
    return tl.where(ok != 0, chosen, -1), floor_key, ranked


@triton.jit
def sample_stats_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fws_ptr, iws_ptr,
                        VOCAB: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        GROUPS: tl.constexpr, NGROUPS: tl.constexpr, NCAND: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row_ptr = logits_ptr + row * VOCAB
    fws, iws = _row_workspace(fws_ptr, iws_ptr, row, SPLITS, NGROUPS, NCAND)
    t, greedy, k, use_k, top_p, use_p, min_p, use_min, need_z = _row_params(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, VOCAB)
    lo = part * CHUNK
    hi = tl.minimum(lo + CHUNK, VOCAB)
    # Each lane keeps its earliest maximum (argmax: first index on ties) and, where needed, its mass
    # sum(exp((x - lane max) / t)), one exp a token.
    lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK], tl.int32)
    lane_z = tl.zeros([BLOCK], tl.float32)
    if need_z:
        for start in range(0, CHUNK, BLOCK):
            offs = lo + start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)     # NaN counts as the maximum (kernels/argmax says why)
            take = x > lane_best
            e = tl.exp((tl.minimum(x, lane_best) - tl.maximum(x, lane_best)) / t)
            e = tl.where(x == float("-inf"), 0.0, e)
            lane_z = tl.where(take, lane_z * e + 1.0, lane_z + e)
            lane_idx = tl.where(take, offs, lane_idx)
            lane_best = tl.where(take, x, lane_best)
    else:
        for start in range(0, CHUNK, BLOCK):
            offs = lo + start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)
            take = x > lane_best
            lane_idx = tl.where(take, offs, lane_idx)
            lane_best = tl.where(take, x, lane_best)
    best = tl.max(lane_best, axis=0)
    tl.store(fws + part, best)
    tl.store(iws + part, tl.min(tl.where(lane_best == best, lane_idx, VOCAB), axis=0))
    if not greedy:
        g = tl.arange(0, GROUPS)
        tl.store(fws + 2 * SPLITS + part * GROUPS + g,
                 tl.max(tl.reshape(lane_best, [GROUPS, BLOCK // GROUPS]), axis=1))
        if need_z:
            # masses relative to the slice's maximum (the bound rescales them to the row's)
            w = tl.where(lane_best == float("-inf"), 0.0, lane_z * tl.exp((lane_best - best) / t))
            tl.store(fws + SPLITS + part, tl.sum(w, axis=0))
            tl.store(fws + 2 * SPLITS + NGROUPS + part * GROUPS + g,
                     tl.sum(tl.reshape(w, [GROUPS, BLOCK // GROUPS]), axis=1))


@triton.jit
def sample_bound_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniform_ptr, min_p_ptr, out_ptr,
                        fws_ptr, iws_ptr, VOCAB: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, GROUPS: tl.constexpr, NGROUPS: tl.constexpr, NCAND: tl.constexpr,
                        RADIX: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * VOCAB
    fws, iws = _row_workspace(fws_ptr, iws_ptr, row, SPLITS, NGROUPS, NCAND)
    t, greedy, k, use_k, top_p, use_p, min_p, use_min, need_z = _row_params(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, VOCAB)
    sl = tl.arange(0, SPLITS)
    part_max = tl.load(fws + sl)
    best_val = tl.max(part_max, axis=0)
    best_idx = tl.min(tl.where(part_max == best_val, tl.load(iws + sl), VOCAB), axis=0)
    mode_ptr = iws + 2 * SPLITS + NCAND
    # NaN or +inf logits (or none above -inf) leave no distribution to draw from: such a row takes its
    # argmax, a valid id (an id outside the vocabulary would stop the engine at the next embedding gather)
    if greedy | (best_val == float("inf")) | (best_val == float("-inf")):
        tl.store(out_ptr + row, best_idx.to(tl.int64))
        tl.store(mode_ptr, tl.full([], DONE, tl.int32))
        return
    m = best_val / t    # the max scaled logit (the max token's own scaled value)
    u = tl.load(uniform_ptr + row)
    # each slice's mass relative to m (0 where the row does not need Z: part_z is not written then)
    scale = tl.where(part_max == float("-inf"), 0.0, tl.exp((part_max - best_val) / t))
    slice_z = tl.where(need_z, tl.load(fws + SPLITS + sl) * scale, 0.0)
    z_row = tl.sum(slice_z, axis=0)
    if need_z & (~use_p):
        # no filter: the slice where the running mass passes u * Z, then the token inside it
        target = u * z_row
        cum = tl.cumsum(slice_z, axis=0)
        j = tl.min(tl.where(cum > target, sl, SPLITS), axis=0)
        chosen = tl.full([], VOCAB - 1, tl.int32)     # rounding left target unreached: the last token
        if j < SPLITS:
            before = tl.sum(tl.where(sl < j, slice_z, 0.0), axis=0)
            lo = j * CHUNK
            chosen = thresholds.draw_stream(row_ptr, lo, tl.minimum(lo + CHUNK, VOCAB), t, m, thresholds.KEY_MIN,
                                            0.0, target, before, BLOCK)
        tl.store(out_ptr + row, chosen.to(tl.int64))
        tl.store(mode_ptr, tl.full([], DONE, tl.int32))
        return

    # The bound L (a key) below which no token can be kept, where one is known from the groups alone.
    # Group maxima are tokens of the row: the k-th largest of them is at or below the k-th largest token.
    margin = 1e-3 + tl.abs(m) * 1e-6     # in scaled-logit units: rounding of exp, log and the division
    min_key = thresholds.order_key(m + tl.log(tl.maximum(min_p, 1e-30)) - margin)
    gi = tl.arange(0, NGROUPS)
    group_max = tl.load(fws + 2 * SPLITS + gi)
    group_keys = thresholds.order_key(group_max / t)
    bound_key = tl.full([], thresholds.KEY_MIN, tl.int64)
    p_key = tl.full([], thresholds.KEY_MIN, tl.int64)
    if use_k:
        if k <= NGROUPS:
            bound_key = thresholds.select(group_keys, tl.full([NGROUPS], 1.0, tl.float32), k.to(tl.float32), 16,
                                          RADIX)
    elif use_p:
        top = tl.where(group_max == float("-inf"), 0.0, tl.exp((group_max - best_val) / t))
        slice_scale = tl.reshape(tl.broadcast_to(scale[:, None], [SPLITS, GROUPS]), [NGROUPS])
        mass = tl.load(fws + 2 * SPLITS + NGROUPS + gi) * slice_scale
        per_group = (BLOCK // GROUPS) * ((CHUNK + BLOCK - 1) // BLOCK)
        p_key = thresholds.mass_bound(group_keys, top, mass, m, top_p * z_row * (1.0 + 1e-5), per_group, RADIX)
        bound_key = tl.where(use_min, tl.maximum(p_key, min_key), p_key)
    elif use_min:
        bound_key = min_key
    candidates = (use_k & (k <= NGROUPS)) | ((~use_k) & (use_p | use_min))
    tl.store(fws + 2 * SPLITS + 2 * NGROUPS + NCAND, m)
    tl.store(fws + 2 * SPLITS + 2 * NGROUPS + NCAND + 1, z_row)
    tl.store(mode_ptr, tl.where(candidates, CANDIDATES, FALLBACK))
    tl.store(mode_ptr + 1, bound_key.to(tl.int32))
    tl.store(mode_ptr + 2, ((~use_min) | (p_key >= min_key)).to(tl.int32))


@triton.jit
def sample_compact_kernel(logits_ptr, temperature_ptr, fws_ptr, iws_ptr, VOCAB: tl.constexpr,
                          SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CAP_S: tl.constexpr,
                          NGROUPS: tl.constexpr, NCAND: tl.constexpr, PDL: tl.constexpr):
    """Stores the slice's tokens with key >= the bound (scaled value, index) in vocabulary order, the first
    CAP_S of them, and how many there are (more than CAP_S: the candidates are incomplete)."""
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    fws, iws = _row_workspace(fws_ptr, iws_ptr, row, SPLITS, NGROUPS, NCAND)
    if tl.load(iws + 2 * SPLITS + NCAND) != CANDIDATES:
        return
    bound_key = tl.load(iws + 2 * SPLITS + NCAND + 1).to(tl.int64)
    t = tl.load(temperature_ptr + row)
    row_ptr = logits_ptr + row * VOCAB
    val_ptr = fws + 2 * SPLITS + 2 * NGROUPS + part * CAP_S
    idx_ptr = iws + 2 * SPLITS + part * CAP_S
    lo = part * CHUNK
    hi = tl.minimum(lo + CHUNK, VOCAB)
    count = tl.zeros([], tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offs = lo + start + tl.arange(0, BLOCK)
        s = thresholds.scaled(row_ptr, offs, hi, t)
        take = (offs < hi) & (thresholds.order_key(s) >= bound_key)
        n = tl.sum(take.to(tl.int32), axis=0)
        if n > 0:       # a block without candidates skips the scan
            pos = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
            ok = take & (pos < CAP_S)
            tl.store(val_ptr + pos, s, mask=ok)
            tl.store(idx_ptr + pos, offs, mask=ok)
        count += n
    tl.store(iws + SPLITS + part, count)


@triton.jit
def sample_finish_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniform_ptr, min_p_ptr, out_ptr,
                         fws_ptr, iws_ptr, VOCAB: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         CAP_S: tl.constexpr, SMALL: tl.constexpr, NGROUPS: tl.constexpr, NCAND: tl.constexpr,
                         RADIX: tl.constexpr, PAIRWISE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    fws, iws = _row_workspace(fws_ptr, iws_ptr, row, SPLITS, NGROUPS, NCAND)
    mode = tl.load(iws + 2 * SPLITS + NCAND)
    if mode == DONE:
        return
    t, greedy, k, use_k, top_p, use_p, min_p, use_min, need_z = _row_params(
        temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, VOCAB)
    row_ptr = logits_ptr + row * VOCAB
    m = tl.load(fws + 2 * SPLITS + 2 * NGROUPS + NCAND)
    z_row = tl.load(fws + 2 * SPLITS + 2 * NGROUPS + NCAND + 1)
    p_may_fall_below = tl.load(iws + 2 * SPLITS + NCAND + 2) != 0
    u = tl.load(uniform_ptr + row)
    chosen = tl.full([], -1, tl.int32)
    if mode == CANDIDATES:
        counts = tl.load(iws + SPLITS + tl.arange(0, SPLITS))
        total = tl.sum(counts, axis=0)
        val_ptr = fws + 2 * SPLITS + 2 * NGROUPS
        idx_ptr = iws + 2 * SPLITS
        if tl.max(counts, axis=0) <= CAP_S:
            # (each branch's registers keep their own names: Triton merges same-named values of the two)
            if total <= SMALL:
                cs, ci, valid = _gather(val_ptr, idx_ptr, counts, total, VOCAB, SPLITS, CAP_S, SMALL)
                # the ranks' copy of the candidates goes over the group maxima and masses (read by the bound
                # alone; specs.py turns the ranks off where SMALL exceeds NGROUPS)
                chosen, small_floor, small_ranked = _finish(cs, ci, valid, total, m, k, use_k, top_p, min_p,
                                                            z_row, p_may_fall_below, u, fws + 2 * SPLITS,
                                                            fws + 2 * SPLITS + NGROUPS, VOCAB, RADIX, PAIRWISE)
            else:
                all_s, all_i, all_valid = _gather(val_ptr, idx_ptr, counts, total, VOCAB, SPLITS, CAP_S, NCAND)
                chosen, all_floor, all_ranked = _finish(all_s, all_i, all_valid, total, m, k, use_k, top_p,
                                                        min_p, z_row, p_may_fall_below, u, fws, fws, VOCAB,
                                                        RADIX, 0)
    if chosen < 0:
        floor_key = tl.full([], thresholds.KEY_MIN, tl.int64)
        if use_k:
            floor_key = thresholds.radix_search(row_ptr, t, m, floor_key, k.to(tl.float32), False, VOCAB, BLOCK)
        if use_p:
            z = z_row      # without top-k, the stats'
            if use_k:
                z = thresholds.kept_mass(row_ptr, t, m, floor_key, 0.0, VOCAB, BLOCK)
            tp = thresholds.radix_search(row_ptr, t, m, floor_key, top_p * z, True, VOCAB, BLOCK)
            floor_key = tl.minimum(tp, thresholds.order_key(m))
        target = u * thresholds.kept_mass(row_ptr, t, m, floor_key, min_p, VOCAB, BLOCK)
        chosen = thresholds.draw_stream(row_ptr, 0, VOCAB, t, m, floor_key, min_p, target, 0.0, BLOCK)
    tl.store(out_ptr + row, chosen.to(tl.int64))
