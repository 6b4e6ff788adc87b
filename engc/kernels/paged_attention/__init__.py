"""Causal attention of a flat batch of query tokens over the paged KV cache (prefill, extend and decode).

ONNX: ai.engc::PagedAttention(q, kv_cache, block_tables, context_lens, query_start_loc) -> out,
attributes num_heads, num_kv_heads, head_dim, scale, sliding_window (0 = none), and softcap where the
model caps its attention scores (Gemma 2: score -> softcap * tanh(score / softcap) after the scale, before
the mask; absent or 0 = none; the GPU kernels lack it, so GPU builds of such models are refused).
Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]; they are the last tokens of its
context of context_lens[b] tokens, whose keys are in the blocks listed by block_tables[b]. A query at
absolute position p sees keys at positions (p - sliding_window, p]. GQA: query head h reads KV head
h // (num_heads // num_kv_heads).
A quantized cache (int8 or float8_e4m3fn codes, engc build --kv-cache) has a 6th input, kv_scale
[2, num_blocks, block_size, num_kv_heads] float32; keys and values are codes * scale (kernels/kv_quant.py).

ONNX: ai.engc::RotaryPagedAttention(qkv, positions, inv_freq, kv_cache, slot_mapping, block_tables,
context_lens, query_start_loc[, kv_scale]) -> out, PagedAttention's attributes: RotaryKVWrite then
PagedAttention as one node (compiler/passes/fuse_rotary_attention.py), so a decode-only step runs both in
one launch (launch_rotary_decode); other steps launch the two kernels.
"""
import torch

from engc.kernels import kv_quant, rotary


def gather_kv(kv_cache, block_table, context_len: int, kv_scale=None):
    block_size = kv_cache.shape[2]
    n_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:context_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:context_len]
    if kv_scale is not None:
        k = kv_quant.dequantize(k, kv_scale[0, blocks].flatten(0, 1)[:context_len])
        v = kv_quant.dequantize(v, kv_scale[1, blocks].flatten(0, 1)[:context_len])
    return k, v  # [context_len, num_kv_heads, head_dim]


def sequence_spans(block_tables, context_lens, query_start_loc):
    """(sequence, first query row, end query row, context length) of each sequence with queries."""
    for b in range(block_tables.shape[0]):
        qs, qe = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if qe > qs:
            yield b, qs, qe, int(context_lens[b])


def paged_attention(q, kv_cache, block_tables, context_lens, query_start_loc,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    sliding_window: int = 0, kv_scale=None, softcap: float = 0.0) -> torch.Tensor:
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    for b, qs, qe, ctx in sequence_spans(block_tables, context_lens, query_start_loc):
        k, v = gather_kv(kv_cache, block_tables[b], ctx, kv_scale)
        qb = q[qs:qe].reshape(qe - qs, num_heads, head_dim).float().transpose(0, 1)  # [H, n, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)                 # [H, ctx, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qb @ k.transpose(1, 2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (qe - qs), ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v                                         # [H, n, D]
        out[qs:qe] = o.transpose(0, 1).reshape(qe - qs, num_heads * head_dim).to(q.dtype)
    return out


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, decode_consts: dict) -> int:
    """How many programs share one (sequence, KV head) in the split-KV decode kernel: enough to reach
    target_programs, each with at least a minimum of context, since a split costs a partial write (and,
    for a kernel without the in-kernel reduce, a share of the reduce launch). The minimum is
    min_split_tokens while (sequence, KV head) pairs alone fill less than half of target_programs, else
    min_split_tokens_busy. The tune table gives the in-kernel-reducing decode one BLOCK_N tile as
    min_split_tokens and two as min_split_tokens_busy (each entry's `why` gives the reason)."""
    ctx = max(max_context_len, 1)
    pairs = max(num_seqs, 1) * num_kv_heads
    busy = 2 * pairs >= decode_consts["target_programs"]
    min_tokens = decode_consts.get("min_split_tokens_busy" if busy else "min_split_tokens", 1)
    tiles = _cdiv(ctx, decode_consts["BLOCK_N"])
    wanted = _cdiv(decode_consts["target_programs"], pairs)
    return max(1, min(decode_consts["max_splits"], tiles, ctx // min_tokens, wanted))


def decode_variant(consts: dict, quantized_cache: bool = False) -> str:
    """'decode_cuda' (the CUDA C++ template's kernel) where the decode record's tune entry chose impl "cuda"
    and the bundle has that kernel (nvcc was present at build time) and the cache is not quantized;
    else 'decode' (Triton). The CUDA one leaves its partials to decode_reduce."""
    if consts["decode"].get("impl") == "cuda" and "decode_cuda" in consts and not quantized_cache:
        return "decode_cuda"
    return "decode"


def reduces_in_kernel(consts: dict, variant: str) -> bool:
    """True for a decode kernel that combines its own splits (counters argument, no decode_reduce launch);
    a 'decode' record without the flag keeps the two-launch form."""
    return bool(consts[variant].get("in_kernel_reduce"))


def decode_workspace(num_seqs: int, num_heads: int, head_dim: int, num_splits: int, device):
    """Partial results of the split-KV decode: (acc [S*H*splits*D], max/sum [S*H*splits*2]) float32."""
    n = num_seqs * num_heads * num_splits
    return (torch.empty(n * head_dim, dtype=torch.float32, device=device),
            torch.empty(n * 2, dtype=torch.float32, device=device))


def decode_counters(num_seqs: int, num_kv_heads: int, device) -> torch.Tensor:
    """Arrival counters of the in-kernel reduce, one int32 per (sequence, KV head), zero. A split launch
    leaves them zero again, so the runtime makes one array before any CUDA graph capture and shares it."""
    return torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device)


def launch(q, kv_cache, block_tables, context_lens, query_start_loc, out, *, num_heads: int, num_kv_heads: int,
           head_dim: int, scale: float, sliding_window: int = 0, max_query_len: int,
           max_context_len: int | None = None, decode_rows: bool = True, workspace=None, consts, kv_scale=None,
           counters=None):
    """Launch rule of the paged-attention kernels: [(variant, grid, args)], in launch order.

    q, out contiguous [T, H * D]; kv_cache contiguous [2, blocks, block_size, KV, D]; block_tables
    [B, max_blocks], context_lens [B], query_start_loc [B + 1], all int32. Host-side facts:
    max_query_len (the longest query slice), max_context_len (bounds the split count; defaults to the
    block table's capacity; keep it fixed when capturing a CUDA graph), decode_rows (False when no sequence
    has exactly one query token: skips the decode launch beside a prefill). consts: variant -> the
    record's 'launch' dict, for 'decode', 'prefill' (and 'decode_cuda', 'decode_reduce'). workspace:
    decode_workspace(...) with at least this launch's split count, else allocated here.

    kv_scale: the float32 [2, blocks, block_size, KV] scales of a quantized (int8/fp8) kv_cache; its
    halves k_scale, v_scale are appended to the 'decode' and 'prefill' args below, before the scratch
    zeros (the same variant names: a bundle's kernels are specialized on its one KV-cache format).

    counters: int32, zero, at least B * KV long (decode_counters; the runtime shares one array between the
    split-K kernels, each launch leaves it zero), else allocated here; an in-kernel-reducing decode takes a
    ticket at counters[b * KV + kv_head].

    args of 'decode' (grid (B, KV, splits); part_acc, part_ml, counters are 0 (null) when splits == 1):
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, part_acc, part_ml, counters,
        scale (fp32), sliding_window (i32), block_table_stride (i32), num_splits (i32), 0, 0
        (a 'decode' record without launch['in_kernel_reduce']: no counters, and a 'decode_reduce' launch
        follows a split one)
    args of 'decode_cuda' (instead of 'decode', see decode_variant): as a 'decode' without in_kernel_reduce,
        without the two scratch zeros; followed by 'decode_reduce' when splits > 1
    args of 'decode_reduce' (grid (B, H), only after a split 'decode_cuda', or a 'decode'
        without in_kernel_reduce):
        query_start_loc, part_acc, part_ml, out, num_splits (i32), 0, 0
    args of 'prefill' (grid (cdiv(max_query_len, BLOCK_M // GROUP), B, KV)):
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        scale (fp32), sliding_window (i32), block_table_stride (i32), skip_decode (i32), 0, 0
    """
    assert q.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous()
    assert block_tables.dtype == context_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert (kv_scale is not None) == kv_quant.is_quantized(kv_cache.dtype)
    assert kv_scale is None or kv_scale.is_contiguous()
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return []
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    bt_stride = block_tables.stride(0)
    scales = [] if kv_scale is None else [kv_scale[0], kv_scale[1]]
    common = [q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out]
    launches = []
    if max_query_len > 1:
        skip = 1 if decode_rows else 0
        p = consts["prefill"]
        tokens = p["BLOCK_M"] // p["GROUP"]
        launches.append(("prefill", (_cdiv(max_query_len, tokens), num_seqs, num_kv_heads),
                         common + [float(scale), int(sliding_window), bt_stride, skip, *scales, 0, 0]))
        if not decode_rows:
            return launches
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * kv_cache.shape[2]
    variant = decode_variant(consts, kv_scale is not None)
    in_kernel = reduces_in_kernel(consts, variant)
    splits, part_acc, part_ml, counters = _split_buffers(num_seqs, num_heads, num_kv_heads, head_dim,
                                                         max_context_len, consts[variant], in_kernel, workspace,
                                                         counters, q.device)
    ticket = [counters] if in_kernel else []
    scratch = [] if variant == "decode_cuda" else [0, 0]    # only Triton kernels take scratch pointers
    launches.append((variant, (num_seqs, num_kv_heads, splits),
                     common + [part_acc, part_ml, *ticket, float(scale), int(sliding_window), bt_stride, splits,
                               *scales, *scratch]))
    if splits > 1 and not in_kernel:
        launches.append(("decode_reduce", (num_seqs, num_heads, 1),
                         [query_start_loc, part_acc, part_ml, out, splits, 0, 0]))
    return launches


def _split_buffers(num_seqs, num_heads, num_kv_heads, head_dim, max_context_len, decode_consts, in_kernel,
                   workspace, counters, device):
    """(splits, part_acc, part_ml, counters) of a decode launch; the buffers are 0 (null) with one split."""
    splits = decode_splits(num_seqs, num_kv_heads, max_context_len, decode_consts)
    if in_kernel and counters is not None and counters.numel() < num_seqs * num_kv_heads:
        splits = 1                        # more (sequence, KV head) pairs than counters: fill the GPU anyway
    if splits == 1:
        return 1, 0, 0, 0
    if workspace is None:
        workspace = decode_workspace(num_seqs, num_heads, head_dim, splits, device)
    part_acc, part_ml = workspace
    assert part_ml.numel() >= num_seqs * num_heads * splits * 2
    if in_kernel and counters is None:
        counters = decode_counters(num_seqs, num_kv_heads, device)
    return splits, part_acc, part_ml, counters


# ---- ai.engc::RotaryPagedAttention: RotaryKVWrite -> PagedAttention as one op (passes/fuse_rotary_attention)

def rotary_paged_attention(qkv, positions, inv_freq, kv_cache, slot_mapping, block_tables, context_lens,
                           query_start_loc, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                           sliding_window: int = 0, kv_scale=None, softcap: float = 0.0) -> torch.Tensor:
    """ONNX: ai.engc::RotaryPagedAttention(qkv, positions, inv_freq, kv_cache, slot_mapping, block_tables,
    context_lens, query_start_loc[, kv_scale]) -> out, with PagedAttention's attributes: exactly
    RotaryKVWrite (rotary on q and k, k and v written to the cache) then PagedAttention on its q."""
    q = rotary.rotary_kv_write(qkv, positions, inv_freq, kv_cache, slot_mapping, num_heads, num_kv_heads,
                               head_dim, kv_scale=kv_scale)
    return paged_attention(q, kv_cache, block_tables, context_lens, query_start_loc, num_heads, num_kv_heads,
                           head_dim, scale, sliding_window, kv_scale=kv_scale, softcap=softcap)


def fuses_rotary(consts: dict, positions, slot_mapping) -> bool:
    """Whether a decode-only step can run RotaryPagedAttention as one launch: the bundle has the fused
    kernel (a 'decode_rotary' record), the int64 positions and slots it was compiled for, and no more
    rows than its tune entry's rotary_max_rows (0 or absent: any; larger batches run faster as the pair)."""
    if "decode_rotary" not in consts or not positions.dtype == slot_mapping.dtype == torch.int64:
        return False
    limit = consts["decode_rotary"].get("rotary_max_rows") or 0
    return limit == 0 or positions.shape[0] <= limit


def launch_rotary_decode(qkv, positions, inv_freq, kv_cache, slot_mapping, block_tables, context_lens,
                         query_start_loc, out, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                         sliding_window: int = 0, max_context_len: int | None = None, workspace=None, consts,
                         kv_scale=None, counters=None):
    """Launch rule of 'decode_rotary' (paged_decode_rotary_kernel): RotaryPagedAttention on a step where
    every sequence has one query token (else: rotary.launch, then launch). Inputs as RotaryKVWrite's
    (qkv contiguous [T, (H + 2 KV) * D], int64 positions and slot_mapping [T]) and PagedAttention's; out
    contiguous [T, H * D]. Splits, workspace and counters as for 'decode'.

    args (grid (B, KV, splits)): qkv, positions, inv_freq, slot_mapping, k_cache, v_cache, block_tables,
        context_lens, query_start_loc, out, part_acc, part_ml, counters, scale (fp32), sliding_window (i32),
        block_table_stride (i32), num_splits (i32), [k_scale, v_scale], 0, 0
    'decode_rotary_cluster' instead (the CUDA cluster kernel, templates/paged_decode_cluster.cu.j2) where the
    bundle has it, the cache is not quantized, B <= its launch's max_seqs and max_context_len <= its
    max_context (a decode graph of the short-context bucket; the capacity-sized one runs Triton's):
    grid (B, KV, cluster), args
        qkv, positions, inv_freq, slot_mapping, k_cache, v_cache, block_tables, context_lens,
        query_start_loc, out, scale (fp32), sliding_window (i32), block_table_stride (i32)
    """
    assert qkv.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous()
    assert positions.dtype == slot_mapping.dtype == torch.int64 and inv_freq.dtype == torch.float32
    assert block_tables.dtype == context_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert (kv_scale is not None) == kv_quant.is_quantized(kv_cache.dtype)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or qkv.shape[0] == 0:
        return []
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * kv_cache.shape[2]
    cluster = consts.get("decode_rotary_cluster")
    if (cluster is not None and kv_scale is None and num_seqs <= cluster["max_seqs"]
            and max_context_len <= cluster["max_context"]):
        return [("decode_rotary_cluster", (num_seqs, num_kv_heads, cluster["cluster"]),
                 [qkv, positions, inv_freq, slot_mapping, kv_cache[0], kv_cache[1], block_tables, context_lens,
                  query_start_loc, out, float(scale), int(sliding_window), block_tables.stride(0)])]
    splits, part_acc, part_ml, counters = _split_buffers(num_seqs, num_heads, num_kv_heads, head_dim,
                                                         max_context_len, consts["decode_rotary"], True,
                                                         workspace, counters, qkv.device)
    scales = [] if kv_scale is None else [kv_scale[0], kv_scale[1]]
    return [("decode_rotary", (num_seqs, num_kv_heads, splits),
             [qkv, positions, inv_freq, slot_mapping, kv_cache[0], kv_cache[1], block_tables, context_lens,
              query_start_loc, out, part_acc, part_ml, counters, float(scale), int(sliding_window),
              block_tables.stride(0), splits, *scales, 0, 0])]
