"""Sampling kernel: one program per row, streaming the row in BLOCK_V chunks (it never fits in registers).

Top-k and top-p thresholds are found without sorting: a radix-4 search over order-preserving int32 keys
of the scaled logits, 16 passes of the row for each threshold, every pass counting (top-k) or summing
exp mass (top-p) at 4 candidate thresholds at once. Rows that use neither filter take 3 passes, greedy
rows one. Inside a pass every thread accumulates its own lanes and the lanes are reduced once at the end,
so the chunk loop carries no cross-warp reduction and its loads stay in flight.
"""
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _scaled(row_ptr, offs, temperature, VOCAB: tl.constexpr):
    x = tl.load(row_ptr + offs, mask=offs < VOCAB, other=float("-inf")).to(tl.float32)
    return x / temperature


@triton.jit
def _radix_search(row_ptr, temperature, m, floor_key, target, USE_MASS: tl.constexpr,
                  VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    """Largest key t with F(t) >= target, F(t) = count (or exp mass) of tokens with key >= max(t, floor)."""
    digits = tl.arange(0, 4).to(tl.int64)
    prefix = tl.full([], -2147483648, tl.int64)
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
def _kept_mass(row_ptr, t, m, floor_key, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    z = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        keep = (offs < VOCAB) & (_order_key(s) >= floor_key)
        z += tl.where(keep, tl.exp(s - m), 0.0)
    return tl.sum(z, axis=0)


@triton.jit
def sample_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniform_ptr, out_ptr,
                  VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * VOCAB
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    t = tl.where(greedy, 1.0, temperature)

    # Pass 1: argmax (first index on ties; each lane keeps its earliest maximum) and the max logit.
    lane_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < VOCAB, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)     # NaN counts as the maximum (kernels/argmax says why)
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
    m = best_val / t    # x / t is monotone in x, so this is the max scaled logit

    floor_key = tl.full([], -2147483648, tl.int64)
    k = tl.load(top_k_ptr + row)
    if (k > 0) & (k < VOCAB):
        floor_key = _radix_search(row_ptr, t, m, floor_key, k.to(tl.float32), False, VOCAB, BLOCK_V)
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:
        z = _kept_mass(row_ptr, t, m, floor_key, VOCAB, BLOCK_V)
        floor_key = _radix_search(row_ptr, t, m, floor_key, top_p * z, True, VOCAB, BLOCK_V)

    # Inverse CDF in vocabulary order: find the chunk where the running mass passes the target, then
    # the token inside it.
    target = tl.load(uniform_ptr + row) * _kept_mass(row_ptr, t, m, floor_key, VOCAB, BLOCK_V)
    running = tl.zeros([], tl.float32)
    before = tl.zeros([], tl.float32)
    cross = tl.full([], -1, tl.int32)
    lane_last = tl.full([BLOCK_V], -1, tl.int32)
    for start in range(0, VOCAB, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        keep = (offs < VOCAB) & (_order_key(s) >= floor_key)
        chunk = tl.sum(tl.where(keep, tl.exp(s - m), 0.0), axis=0)
        hit = (cross < 0) & (running + chunk > target)
        cross = tl.where(hit, start, cross)
        before = tl.where(hit, running, before)
        running += chunk
        lane_last = tl.maximum(lane_last, tl.where(keep, offs, -1))
    chosen = tl.max(lane_last, axis=0)
    if cross >= 0:
        offs = cross + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, offs, t, VOCAB)
        keep = (offs < VOCAB) & (_order_key(s) >= floor_key)
        cum = tl.cumsum(tl.where(keep, tl.exp(s - m), 0.0), axis=0) + before
        first = tl.min(tl.where(keep & (cum > target), offs, VOCAB), axis=0)
        last_in_chunk = tl.max(tl.where(keep, offs, -1), axis=0)
        chosen = tl.where(first < VOCAB, first, last_in_chunk)
    tl.store(out_ptr + row, chosen.to(tl.int64))
