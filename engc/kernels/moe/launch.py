"""The MoE op's GPU path: the grouped GEMMs' schedule (sort_blocks, sort_by_expert: the reference of the sort
kernel), the launch rules, each turning tensors into [(variant, grid, args)] for the kernels of triton.py, and
forward(), the order the binding (bind.py) runs them in. The op's contract and its torch reference are
__init__.py's; like it, this module imports no Triton.
"""
from __future__ import annotations

import torch

from engc.kernels import fp8_quant
from engc.kernels.moe import DEEPSEEK_ROUTING, expert_inputs


def sort_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The schedule's blocks for num_pairs pairs: room for every expert's padding, so the sizes follow from the
    shapes alone (nothing waits on the GPU, and a CUDA graph can hold them)."""
    return (num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """The grouped GEMMs' schedule: each (token, slot) pair listed under its expert, in pair order, each
    expert's list padded to a multiple of block_m, so every BLOCK_M rows of the sorted list belong to one
    expert. The reference of moe_sort_kernel (launch_sort), which the GPU path runs.

    ids [T, k] -> (rows [sort_blocks * block_m] int32: the pair's flat index t * k + slot, T * k for padding;
                   block_expert [sort_blocks] int32: the expert of each block, -1 past the last one)
    """
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    blocks = sort_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    rows[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block_m, right=True)
    return rows, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def launch_router(x, router, logits, consts, variant: str = "router"):
    """moe_router_kernel, grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E)). args: x, router [E, H], logits [T, E] in
    the model dtype ("router") or float32 ("router_deepseek"), T, scratch, scratch. Up to the "_small"
    variant's max_tokens tokens take it (absent from a bundle compiled without it: the tiled one)."""
    if x.shape[0] == 0:
        return []
    small = consts.get(variant + "_small")
    if small and x.shape[0] <= small["max_tokens"]:
        variant = variant + "_small"
    c = consts[variant]
    return [(variant, (_cdiv(x.shape[0], c["BLOCK_T"]), _cdiv(router.shape[0], c["BLOCK_E"]), 1),
             [x, router, logits, x.shape[0], 0, 0])]


def launch_route(x, logits, shared_gate, weights, ids, shared_weight, softmax_first: int, renormalize: int,
                 float32_weights: int = 0):
    """moe_route_kernel, grid (T,). args: x, logits [T, E] (launch_router's), shared_gate, weights [T, k] f32,
    ids [T, k] i32, shared_weight [T] f32, softmax_first, renormalize, float32_weights, scratch, scratch.
    shared_gate and shared_weight are any tensor where the model has no shared expert (the kernel, compiled
    without it, reads neither)."""
    if x.shape[0] == 0:
        return []
    return [("route", (x.shape[0], 1, 1), [x, logits, shared_gate, weights, ids, shared_weight,
                                          int(softmax_first), int(renormalize), int(float32_weights), 0, 0])]


def launch_route_deepseek(x, logits, bias, weights, ids, shared_weight, renormalize: int, float32_weights: int,
                          sigmoid_scores: int = 0, n_group: int = 1, topk_group: int = 1, group_top2: int = 0,
                          routed_scaling_factor: float = 1.0):
    """moe_route_deepseek_kernel, grid (T,): route()'s DeepSeek routings. args: x (its dtype), logits [T, E]
    float32 (launch_router's "router_deepseek"), bias [E] f32 (any float32 tensor without one), weights, ids,
    shared_weight (1 for DeepSeek's ungated shared experts),
    sigmoid_scores, has_bias, n_group, topk_group, group_top2, renormalize, routed_scaling_factor,
    float32_weights, scratch, scratch."""
    if x.shape[0] == 0:
        return []
    return [("route_deepseek", (x.shape[0], 1, 1),
             [x, logits, weights if bias is None else bias, weights, ids, shared_weight, int(sigmoid_scores),
              int(bias is not None), int(n_group), int(topk_group), int(group_top2), int(renormalize),
              float(routed_scaling_factor), int(float32_weights), 0, 0])]


def launch_sort(ids, rows, block_expert, block_m: int, consts):
    """moe_sort_kernel, grid (up to max_programs,): sort_by_expert's rows and block_expert, in one launch, for
    the grouped pair of BLOCK_M block_m (a runtime argument: one kernel serves both pairs). rows and
    block_expert are sized by sort_blocks. args: ids [T, k] i32, rows, block_expert, num_pairs, block_m,
    num_blocks, scratch, scratch."""
    n = ids.numel()
    if n == 0:
        return []
    sort = consts["sort"]
    programs = min(_cdiv(n, sort["RANK_BLOCK"]), sort["max_programs"])
    return [("sort", (programs, 1, 1), [ids, rows, block_expert, n, int(block_m), block_expert.numel(), 0, 0])]


def grouped_variants(num_tokens: int, top_k: int, num_experts: int, consts: dict) -> tuple[str, str] | None:
    """The expert GEMMs' variants for a batch of num_tokens: None for the decode ones (up to
    consts['gate_up_decode']['max_pairs'] pairs: no sort), the prefill pair where the pairs an expert reach
    consts['gate_up_prefill']['prefill_min_rows'] on average (tiles sized for thousands of rows an expert),
    else the grouped pair sized for a few rows an expert. The token count alone decides (known on the host),
    so each batch size a CUDA graph captures keeps one choice."""
    pairs = num_tokens * top_k
    if pairs <= consts["gate_up_decode"]["max_pairs"]:
        return None
    prefill = consts.get("gate_up_prefill")   # absent from a bundle compiled without the prefill variants
    if prefill and pairs >= prefill["prefill_min_rows"] * num_experts:
        return "gate_up_prefill", "down_prefill"
    return "gate_up", "down"


def launch_gate_up(x, gate_up, rows, block_expert, act, num_pairs: int, consts, variant: str,
                   gate_up_scale=None, x_scale=None, gate_up_zero=None):
    """moe_gate_up_kernel over the schedule rows/block_expert (launch_sort's with the variant's BLOCK_M, or for
    the decode variant one pair a program in pair order: rows None, unread, block_expert = ids), grid (blocks,
    cdiv(I, BLOCK_N)). act [T*k, I], a row a (token, slot) pair. fp8 experts: x float8 [T, H] with x_scale [T]
    (kernels/fp8_quant's per-token quantization) and gate_up_scale [E, 2I]; float experts pass x and the
    weight where the scales go (the kernel, compiled without FP8_W, reads neither). int4 experts: gate_up
    int32 [E, 2I, H / 8], its scales and uint8 zeros [E, 2I, H / group] (the engc int4 layout). args: x,
    x_scale, gate_up, gate_up_scale, gate_up_zero, rows, block_expert, act, num_pairs, scratch, scratch."""
    if num_pairs == 0:
        return []
    inter = gate_up.shape[1] // 2   # 2I rows whatever the weights' form
    return [(variant, (block_expert.numel(), _cdiv(inter, consts[variant]["BLOCK_N"]), 1),
             [x, x if x_scale is None else x_scale, gate_up, gate_up if gate_up_scale is None else gate_up_scale,
              gate_up if gate_up_zero is None else gate_up_zero, block_expert if rows is None else rows, block_expert,
              act, num_pairs, 0, 0])]


def launch_down(act, down, rows, block_expert, weights, pairs, consts, variant: str, down_scale=None,
                act_scale=None, down_zero=None):
    """moe_down_kernel over gate_up's schedule (rows None for the decode variant, as there), grid (blocks,
    cdiv(H, BLOCK_N)): pairs [T*k, H] (each pair's weighted expert output). fp8 experts: act float8 [T*k, I]
    with act_scale [T*k] and down_scale [E, H]; int4 experts: down int32 [E, H, I / 8] with its scales and
    zeros. args: act, act_scale, down, down_scale, down_zero, rows, block_expert, weights, pairs, num_pairs,
    scratch, scratch."""
    num_pairs = weights.numel()
    if num_pairs == 0:
        return []
    return [(variant, (block_expert.numel(), _cdiv(down.shape[1], consts[variant]["BLOCK_N"]), 1),
             [act, act if act_scale is None else act_scale, down, down if down_scale is None else down_scale,
              down if down_zero is None else down_zero, block_expert if rows is None else rows, block_expert, weights,
              pairs, num_pairs, 0, 0])]


def fused_decode(consts) -> tuple[bool, bool]:
    """Which decode fusions the bundle compiled (specs, tune field "fused"): (gate_up routes from the router's
    logits itself, so no route launch; down sums each token's pairs, so no combine launch)."""
    return bool(consts["gate_up_decode"].get("fused")), bool(consts["down_decode"].get("fused"))


def launch_gate_up_route(x, gate_up, logits, weights, ids, act, consts, softmax_first: int, renormalize: int,
                         float32_weights: int = 0, gate_up_scale=None, x_scale=None, gate_up_zero=None):
    """moe_gate_up_route_kernel (the fused "gate_up_decode"), grid (T*k, cdiv(I, BLOCK_N)): each program routes
    its pair's token from logits [T, E] (launch_router's) as launch_route's kernel does, writes the pair's
    weight and expert into weights [T, k] f32 and ids [T, k] i32 (the first N tile's programs), and computes
    act [T*k, I] as launch_gate_up's decode variant; the weight forms as there. args: x, x_scale, gate_up,
    gate_up_scale, gate_up_zero, logits, weights, ids, act, softmax_first, renormalize, float32_weights,
    scratch, scratch."""
    if ids.numel() == 0:
        return []
    inter = gate_up.shape[1] // 2
    return [("gate_up_decode", (ids.numel(), _cdiv(inter, consts["gate_up_decode"]["BLOCK_N"]), 1),
             [x, x if x_scale is None else x_scale, gate_up, gate_up if gate_up_scale is None else gate_up_scale,
              gate_up if gate_up_zero is None else gate_up_zero, logits, weights, ids, act, int(softmax_first),
              int(renormalize), int(float32_weights), 0, 0])]


def launch_down_combine(act, down, ids, weights, out, consts, down_scale=None, act_scale=None, down_zero=None):
    """moe_down_combine_kernel (the fused "down_decode"), grid (T, cdiv(H, BLOCK_N)): out [T, H] = the sum of
    each token's k pairs, as launch_down's decode variant then launch_combine compute it, bit for bit (no
    shared expert); ids and weights launch_gate_up_route's, the weight forms as launch_down's. args: act,
    act_scale, down, down_scale, down_zero, ids, weights, out, scratch, scratch."""
    if out.shape[0] == 0:
        return []
    return [("down_decode", (out.shape[0], _cdiv(down.shape[1], consts["down_decode"]["BLOCK_N"]), 1),
             [act, act if act_scale is None else act_scale, down, down if down_scale is None else down_scale,
              down if down_zero is None else down_zero, ids, weights, out, 0, 0])]


def launch_experts(x, gate_up, down, rows, block_expert, weights, act, pairs, consts, variants, logits=None,
                   out=None, routing=None):
    """Float experts' gate_up then down launches (launch_gate_up, launch_down), as forward() makes them: engc
    tune's MoE bench launches a candidate's pair so. variants: grouped_variants' (gate_up, down) pair, None for
    the decode ones. consts: '<variant>' -> {'BLOCK_M', 'BLOCK_N'}. Fused decode variants (fused_decode): a fused
    gate_up routes from logits [T, E] by routing (launch_gate_up_route's softmax_first, renormalize) into
    weights and block_expert (the ids [T, k], which an unfused down reads flat, a block a pair); a fused decode
    down writes out [T, H], not pairs."""
    route, combine = fused_decode(consts) if variants is None else (False, False)
    gate_up_variant, down_variant = variants or ("gate_up_decode", "down_decode")
    return ((launch_gate_up_route(x, gate_up, logits, weights, block_expert, act, consts, **routing) if route else
             launch_gate_up(x, gate_up, rows, block_expert, act, weights.numel(), consts, gate_up_variant))
            + (launch_down_combine(act, down, block_expert, weights, out, consts) if combine else
               launch_down(act, down, rows, block_expert.reshape(-1), weights, pairs, consts, down_variant)))


def launch_combine(pairs, shared, shared_weight, out, consts):
    """moe_combine_kernel, grid (T, cdiv(H, BLOCK)). args: pairs, shared [T, H] (any tensor without a shared
    expert), shared_weight, out, scratch, scratch."""
    if out.shape[0] == 0:
        return []
    block = consts["combine"]["BLOCK"]
    return [("combine", (out.shape[0], (out.shape[1] + block - 1) // block, 1),
             [pairs, shared, shared_weight, out, 0, 0])]


def _quantized(quant, x):
    """x [M, K] as float8 codes and a scale a row, by quant(launches) (fp8_quant's kernel, variant k<K>)."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    quant(fp8_quant.launch(x, q, scale))
    return q, scale


def forward(run, x, router, gate_up, down, *rest, top_k: int, consts: dict, quant=None, softmax_first: int = 1,
            renormalize: int = 0, has_shared_expert: int = 0, group_size: int = 0, float32_weights: int = 0,
            shared_ungated: int = 0, correction_bias: int = 0, fp8_experts: int = 0, **routing) -> torch.Tensor:
    """The MoE node on the GPU: run(launches) runs each launch rule's output (the runtime's BundleKernels, or
    the interpreter in the tests). Up to consts['gate_up_decode']['max_pairs'] (token, expert) pairs take the decode
    variants, which skip the sort; more are sorted by expert and padded to BLOCK_M for the grouped GEMMs (one
    launch of the sort kernel, its outputs sized from the shapes), the prefill pair's where the pairs an
    expert reach its prefill_min_rows on average (grouped_variants). Where the bundle compiled the decode
    fusions (fused_decode, each a tune field), gate_up routes each pair's token itself (no route launch) and
    down sums each token's pairs into the output (no pairs buffer, no combine launch): three launches with both.
    The shared expert's output (the program's dense MLP) is added by the combine. DeepSeek's routings
    (groups, sigmoid scores, the correction bias, the scaling factor) take their own routing kernel; the
    expert GEMMs and the combine are the same kernels. fp8 experts take the
    gate_up / down variants the bundle compiled with FP8_W (an fp8 bundle's are all so), their inputs
    quantized per row first by quant(launches), which runs kernels/fp8_quant's launches (the fp8 program's
    own per-token quantization, with a variant for the experts' intermediate size)."""
    shared, scales, bias = expert_inputs(rest, has_shared_expert, shared_ungated, correction_bias)
    shared_out, shared_gate = (list(shared) + [None, None])[:2]
    # each GEMM's weight quantization inputs, as its launch rule names them (none for float experts)
    if fp8_experts:
        gate_up_q, down_q = dict(gate_up_scale=scales[0]), dict(down_scale=scales[1])
    elif group_size:
        gate_up_q = dict(gate_up_scale=scales[0], gate_up_zero=scales[1])
        down_q = dict(down_scale=scales[2], down_zero=scales[3])
    else:
        gate_up_q, down_q = {}, {}
    t, e = x.shape[0], gate_up.shape[0]
    out = torch.empty_like(x)
    if t == 0:
        return out
    variants = grouped_variants(t, top_k, e, consts)
    fuse_route, fuse_combine = fused_decode(consts) if variants is None else (False, False)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    shared_weight = torch.empty(t if has_shared_expert else 1, dtype=torch.float32, device=x.device)
    if correction_bias or shared_ungated or any(k in routing for k in DEEPSEEK_ROUTING):
        logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
        run(launch_router(x, router, logits, consts, "router_deepseek"))
        run(launch_route_deepseek(x, logits, bias, weights, ids, shared_weight, renormalize, float32_weights,
                                  **{k: routing[k] for k in DEEPSEEK_ROUTING if k in routing}))
    else:
        logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
        run(launch_router(x, router, logits, consts))
        if not fuse_route:   # a fused decode gate_up routes its pairs itself
            run(launch_route(x, logits, shared_gate if has_shared_expert else router, weights, ids, shared_weight,
                             softmax_first, renormalize, float32_weights))
    if variants is None:   # one pair a program, in pair order: no row list (the decode variants read ids only)
        rows, block_expert = None, ids.reshape(-1)
    else:
        block_m = consts[variants[0]]["BLOCK_M"]
        blocks = sort_blocks(t * top_k, e, block_m)
        rows = torch.empty(blocks * block_m, dtype=torch.int32, device=x.device)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=x.device)
        run(launch_sort(ids, rows, block_expert, block_m, consts))
    act = torch.empty(t * top_k, gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)   # I, packed or not
    gate_up_variant, down_variant = variants or ("gate_up_decode", "down_decode")
    # W8A8: each GEMM's input quantized per row by fp8_quant's kernel first (int4 experts are W4A16: the
    # kernels' INT4_W specialization dequantizes each weight tile)
    x_in, x_scale = _quantized(quant, x) if fp8_experts else (x, None)
    if fuse_route:
        run(launch_gate_up_route(x_in, gate_up, logits, weights, ids, act, consts, softmax_first, renormalize,
                                 float32_weights, x_scale=x_scale, **gate_up_q))
    else:
        run(launch_gate_up(x_in, gate_up, rows, block_expert, act, t * top_k, consts, gate_up_variant,
                           x_scale=x_scale, **gate_up_q))
    act_in, act_scale = _quantized(quant, act) if fp8_experts else (act, None)
    if fuse_combine:   # each token's pairs summed into out by the down GEMM itself
        run(launch_down_combine(act_in, down, ids, weights, out, consts, act_scale=act_scale, **down_q))
        return out
    pairs = torch.empty(t * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    run(launch_down(act_in, down, rows, block_expert, weights, pairs, consts, down_variant, act_scale=act_scale,
                    **down_q))
    run(launch_combine(pairs, shared_out if has_shared_expert else pairs, shared_weight, out, consts))
    return out
