"""The thresholds of the sampling kernels (triton.py) as order keys, and the searches that find them.

A threshold compares order-preserving int32 keys of the scaled logits (held as int64, so a prefix plus a digit
never overflows); -0.0 takes +0.0's key, since the reference compares the floats. select and mass_bound find a
key over values in registers, a radix digit of RADIX bits a step; ranks gives every candidate its count and
mass of candidates at or above it, from which the finish reads the same thresholds without a chain of
dependent reductions (is_select checks a mass threshold against the select's own sums); radix_search,
kept_mass and draw_stream are the fallback, streaming the whole row (correct for any input, 16 passes a
search). Only the compiler imports this module (through triton.py); codegen records it beside the kernel
source (record.py).
"""
import triton
import triton.language as tl

KEY_MIN = tl.constexpr(-2147483648)       # the smallest key: no threshold
BELOW_ALL = tl.constexpr(-2147483649)     # an empty candidate slot's key: below any threshold


@triton.jit
def order_key(x):
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def key_value(key):
    """The float whose order_key is key (the key's bit map is its own inverse)."""
    k32 = key.to(tl.int32)
    return (k32 ^ ((k32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def scaled(row_ptr, offs, hi, temperature):
    x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
    return x / temperature


@triton.jit
def select(keys, weights, target, BITS: tl.constexpr, RADIX: tl.constexpr):
    """Over register values: the largest key t (to its BITS high bits, RADIX bits a step; fewer bits give a
    t at or below the exact one) with sum(weights of keys >= t) >= target. A step is one reduction over
    [len(keys), 2^RADIX]: wider digits take fewer dependent steps for more work each."""
    digits = tl.arange(0, 1 << RADIX).to(tl.int64)
    prefix = tl.full([], KEY_MIN, tl.int64)
    for p in tl.static_range(BITS // RADIX):
        shift = 32 - RADIX * (p + 1)
        total = totals(keys, weights, prefix + (digits << shift))
        best = tl.max(tl.where(total >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def totals(keys, weights, cands):
    """sum(weights of keys >= c) for each c of cands, one reduction over [len(keys), len(cands)]: a select
    step's sums (is_select checks a threshold with the same tile, so it sees the same roundings)."""
    return tl.sum(tl.where(keys[:, None] >= cands[None, :], weights[:, None], 0.0), axis=0)


@triton.jit
def ranks(keys, key_ptr, weight_ptr, n, STEP: tl.constexpr):
    """For each of keys (int32, KEY_MIN in an empty slot): how many of the n candidates at key_ptr (their
    int32 keys, stored as float32 bits) are at or above it, and the sum of those candidates' weights
    (weight_ptr, summed in the candidates' order). The candidates stream STEP a loop step, each loaded by
    every thread alike, so no thread waits on another: no reduction, no barrier."""
    at_least = tl.zeros(keys.shape, tl.int32)
    held = tl.zeros(keys.shape, tl.float32)
    for start in range(0, n, STEP):
        for d in tl.static_range(STEP):
            j = start + d
            key_j = tl.load(key_ptr + j, mask=j < n, other=0.0).to(tl.int32, bitcast=True)
            weight_j = tl.load(weight_ptr + j, mask=j < n, other=0.0)
            above = (key_j >= keys) & (j < n)
            at_least += above.to(tl.int32)
            held += tl.where(above, weight_j, 0.0)
    return at_least, held


@triton.jit
def is_select(keys, weights, target, t, RADIX: tl.constexpr):
    """Whether t is select(keys, weights, target, 32, RADIX)'s answer, from one step's sums (totals): at or
    above t they reach target (or t is KEY_MIN, the answer where nothing does) and above t they do not. A
    step's sum cannot rise as its threshold does (leaves only drop to 0, and each rounding is monotone), so
    the select's search ends at t exactly where these hold."""
    digits = tl.arange(0, 1 << RADIX).to(tl.int64)
    total = totals(keys, weights, tl.where(digits == 0, t, t + 1))
    holds = tl.where(digits == 0, (total >= target) | (t == KEY_MIN), total < target)
    return tl.min(holds.to(tl.int32), axis=0) != 0


@triton.jit
def mass_bound(keys, top, mass, m, target, PER_GROUP: tl.constexpr, RADIX: tl.constexpr):
    """A key t at or below the top-p threshold, from the groups: group j (largest token's mass top_j =
    exp(s_j - m), total mass mass_j over at most PER_GROUP tokens) holds, at or above t <= s_j, at least
    max(top_j, mass_j - (PER_GROUP - 1) exp(t - m)), since its other tokens below t hold less than
    exp(t - m) each. The largest t (to 16 bits) where these lower bounds sum to target leaves at least
    target of mass at or above t in the row."""
    digits = tl.arange(0, 1 << RADIX).to(tl.int64)
    prefix = tl.full([], KEY_MIN, tl.int64)
    for p in tl.static_range(16 // RADIX):
        shift = 32 - RADIX * (p + 1)
        cands = prefix + (digits << shift)
        room = (PER_GROUP - 1) * tl.exp(tl.minimum(key_value(cands) - m, 80.0))
        held = tl.maximum(top[:, None], mass[:, None] - room[None, :])
        total = tl.sum(tl.where(keys[:, None] >= cands[None, :], held, 0.0), axis=0)
        best = tl.max(tl.where(total >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def radix_search(row_ptr, temperature, m, floor_key, target, USE_MASS: tl.constexpr,
                  VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """Largest key t with F(t) >= target, F(t) = count (or exp mass) of tokens with key >= max(t, floor),
    streaming the row 16 times (the fallback)."""
    digits = tl.arange(0, 4).to(tl.int64)
    prefix = tl.full([], KEY_MIN, tl.int64)
    for p in range(16):
        shift = 30 - 2 * p
        cands = prefix + (digits << shift)
        acc = tl.zeros([BLOCK, 4], tl.float32)
        for start in range(0, VOCAB, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            s = scaled(row_ptr, offs, VOCAB, temperature)
            key = order_key(s)
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
def kept_mass(row_ptr, t, m, floor_key, min_p, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    z = tl.zeros([BLOCK], tl.float32)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        s = scaled(row_ptr, offs, VOCAB, t)
        e = tl.exp(s - m)
        keep = (offs < VOCAB) & (order_key(s) >= floor_key) & (e >= min_p)
        z += tl.where(keep, e, 0.0)
    return tl.sum(z, axis=0)


@triton.jit
def draw_stream(row_ptr, lo, hi, t, m, floor_key, min_p, target, before, BLOCK: tl.constexpr):
    """Inverse CDF in vocabulary order over tokens [lo, hi) that follow `before` of kept mass: the block where
    the running kept mass passes target, then the token inside it (the last kept token of the range where
    rounding leaves target unreached)."""
    running = tl.zeros([], tl.float32) + before
    at_cross = running
    cross = tl.full([], -1, tl.int32)
    lane_last = tl.full([BLOCK], -1, tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        s = scaled(row_ptr, offs, hi, t)
        e = tl.exp(s - m)
        keep = (offs < hi) & (order_key(s) >= floor_key) & (e >= min_p)
        chunk = tl.sum(tl.where(keep, e, 0.0), axis=0)
        hit = (cross < 0) & (running + chunk > target)
        cross = tl.where(hit, start, cross)
        at_cross = tl.where(hit, running, at_cross)
        running += chunk
        lane_last = tl.maximum(lane_last, tl.where(keep, offs, -1))
    chosen = tl.max(lane_last, axis=0)
    if cross >= 0:
        offs = cross + tl.arange(0, BLOCK)
        s = scaled(row_ptr, offs, hi, t)
        e = tl.exp(s - m)
        keep = (offs < hi) & (order_key(s) >= floor_key) & (e >= min_p)
        cum = tl.cumsum(tl.where(keep, e, 0.0), axis=0) + at_cross
        first = tl.min(tl.where(keep & (cum > target), offs, hi), axis=0)
        last_in_block = tl.max(tl.where(keep, offs, -1), axis=0)
        chosen = tl.where(first < hi, first, last_in_block)
    return chosen
