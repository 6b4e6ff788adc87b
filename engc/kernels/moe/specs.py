"""The MoE kernels of a mixture-of-experts model: routing, the grouped and the decode expert GEMMs, the combine,
each specialized on the model's hidden size, expert count, top-k and expert intermediate size; DeepSeek's
routings (groups, sigmoid scores, a correction bias) their own routing kernel. An fp8 build's
expert GEMMs are the FP8_W specialization (float8 weights with a float32 scale per channel, inputs quantized
per row by the fp8 program's fp8_quant kernels: kernels/moe); the same variant names, as a bundle's experts
are all fp8 or all float. int4 experts (an AWQ/GPTQ checkpoint's, engc quantize's) are the INT4_W
specialization, their group size. Without a shared expert or DeepSeek's routing, the decode variants can be
fused kernels (gate_up routing its own pairs, down summing each token's), where the tune table says so."""
from dataclasses import replace

from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2

# Untuned starting points (no tune-table line yet; `engc tune --ops moe` measures them): BLOCK_M 16 keeps the
# padding of a lightly loaded expert small (a decode-sized batch: a few to tens of pairs an expert); the
# prefill variants take over where the pairs an expert reach prefill_min_rows on average (a prompt's hundreds
# to thousands of rows an expert: a tile that fills the tensor cores and reads each weight tile for more
# rows; 64, one such tile an expert, Qwen3-30B-A3B's 1024 tokens); the decode variants
# read one expert's rows a program, BLOCK_K wide; up to max_pairs (token, expert) pairs take them, which
# skips the sort. The sort ranks RANK_BLOCK pairs at a time (specs: sized from the expert count) and counts ids
# SCAN_BLOCK at a time; a launch takes up to max_programs programs (one wave on an H100/H200). PDL 0: the
# kernels take programmatic dependent launch (kernels/pdl.py), off until a step A/B on the arch keeps it.
DEFAULTS = {
    # the router's logits: 16 experts a program (8 programs share Qwen3-30B-A3B's 128 at batch 1), 128-deep K
    "router": {"num_warps": 4, "num_stages": 3, "BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 128, "PDL": 0},
    "route": {"num_warps": 4, "num_stages": 1, "BLOCK_K": 64, "PDL": 0},
    "router_deepseek": {"num_warps": 4, "num_stages": 3, "BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 128, "PDL": 0},
    # up to max_tokens tokens (decode steps): a token and two experts a program, the hidden size 1024 at a time
    "router_small": {"num_warps": 4, "num_stages": 2, "BLOCK_T": 1, "BLOCK_E": 2, "BLOCK_K": 1024, "max_tokens": 16,
                     "PDL": 0},
    "router_deepseek_small": {"num_warps": 4, "num_stages": 2, "BLOCK_T": 1, "BLOCK_E": 2, "BLOCK_K": 1024,
                              "max_tokens": 16, "PDL": 0},
    "route_deepseek": {"num_warps": 4, "num_stages": 1, "PDL": 0},
    "gate_up": {"num_warps": 4, "num_stages": 3, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "PDL": 0},
    "down": {"num_warps": 4, "num_stages": 3, "BLOCK_N": 64, "BLOCK_K": 64, "PDL": 0},   # BLOCK_M: gate_up's
    "gate_up_prefill": {"num_warps": 8, "num_stages": 3, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
                        "prefill_min_rows": 64, "PDL": 0},
    # BLOCK_M: gate_up_prefill's
    "down_prefill": {"num_warps": 8, "num_stages": 3, "BLOCK_N": 128, "BLOCK_K": 64, "PDL": 0},
    "gate_up_decode": {"num_warps": 4, "num_stages": 2, "BLOCK_N": 32, "BLOCK_K": 128, "max_pairs": 64, "fused": 0,
                       "PDL": 0},
    "down_decode": {"num_warps": 4, "num_stages": 2, "BLOCK_N": 32, "BLOCK_K": 128, "fused": 0, "PDL": 0},
    "combine": {"num_warps": 4, "num_stages": 1, "BLOCK": 1024, "PDL": 0},
    "sort": {"num_warps": 4, "num_stages": 1, "SCAN_BLOCK": 1024, "max_programs": 128, "PDL": 0},
}


def specs(b: Build) -> list:
    cfg = b.cfg
    if not cfg.num_experts:
        return []
    t, h, e, k, inter = b.t, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    shared = int(cfg.shared_expert_intermediate_size > 0)
    fp8 = b.quant == "fp8"
    # fp8 experts: float8 inputs and weights, each with its float32 scales; int4 experts: the engc int4
    # layout's packed words, model-dtype scales and uint8 zero points. A pointer a form does not read is
    # passed the input or the weight itself (unread), so its type is theirs.
    int4 = b.int4_experts   # the experts' int4 group size (0: float or fp8 experts)
    if int4:
        w = {"w_ptr": "*i32", "w_scale_ptr": f"*{t}", "w_zero_ptr": "*u8"}
    elif fp8:
        w = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "w_zero_ptr": "*fp8e4nv"}
    else:
        w = {"w_ptr": f"*{t}", "w_scale_ptr": f"*{t}", "w_zero_ptr": f"*{t}"}
    x_in = {"x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32"} if fp8 else {"x_ptr": f"*{t}", "x_scale_ptr": f"*{t}"}
    act_in = {"act_ptr": "*fp8e4nv", "act_scale_ptr": "*fp32"} if fp8 else {"act_ptr": f"*{t}",
                                                                          "act_scale_ptr": f"*{t}"}
    gate_up = {**x_in, **w, "rows_ptr": "*i32", "block_expert_ptr": "*i32", "act_ptr": f"*{t}", "num_pairs": "i32"}
    down = {**act_in, **w, "rows_ptr": "*i32", "block_expert_ptr": "*i32", "weights_ptr": "*fp32",
            "pairs_ptr": f"*{t}", "num_pairs": "i32"}
    router = {"x_ptr": f"*{t}", "router_ptr": f"*{t}", "logits_ptr": f"*{t}", "T": "i32"}
    route = {"x_ptr": f"*{t}", "logits_ptr": f"*{t}", "shared_gate_ptr": f"*{t}", "weights_ptr": "*fp32",
             "ids_ptr": "*i32", "shared_weight_ptr": "*fp32", "softmax_first": "i32", "renormalize": "i32",
             "float32_weights": "i32"}
    route_deepseek = {"x_ptr": f"*{t}", "logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
                      "ids_ptr": "*i32", "shared_weight_ptr": "*fp32", "sigmoid_scores": "i32", "has_bias": "i32",
                      "n_group": "i32", "topk_group": "i32", "group_top2": "i32", "renormalize": "i32",
                      "routed_scaling_factor": "fp32", "float32_weights": "i32"}
    sort = {"ids_ptr": "*i32", "rows_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32", "block_m": "i32",
            "num_blocks": "i32"}
    combine = {"pairs_ptr": f"*{t}", "shared_ptr": f"*{t}", "shared_weight_ptr": "*fp32", "out_ptr": f"*{t}"}
    # A routing without a shared expert (Mixtral, Qwen3-MoE, OLMoE) can take two fusions on its decode path, each
    # its decode variant's tune field "fused": gate_up routing each pair's token itself from the router's logits
    # (no route launch), and down summing each token's pairs (no combine launch; one program a token's N tile
    # reads all its experts' rows, where the unfused down spreads them over TOP_K times the programs). Each is on
    # where a step A/B on the arch kept it (gpu_bench.py --tune; sm90 keeps gate_up's, sm80 neither). A shared
    # expert's output joins in the combine, and DeepSeek's routings are their own kernel: those keep all five
    # launches. The fused kernels keep the variant names, so the decode entries size them, and the records say
    # which form they are.
    plain = not shared and not cfg.moe_scored_routing
    fused = {v: plain and bool(tune.lookup(b.arch, "moe", v, "any", b.ov("moe"), DEFAULTS[v])[1].get("fused"))
             for v in ("gate_up_decode", "down_decode")}
    gate_up_route = {**x_in, **w, "logits_ptr": f"*{t}", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                     "act_ptr": f"*{t}", "softmax_first": "i32", "renormalize": "i32", "float32_weights": "i32"}
    down_combine = {**act_in, **w, "ids_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": f"*{t}"}
    # a float32 bundle's GEMMs in full precision, not TF32 (as paged attention's)
    sizes = {"H": h, "INTER": inter, "DOT_PRECISION": "ieee" if t == "fp32" else "tf32", "FP8_W": fp8,
             "INT4_W": int4}
    # each down GEMM walks the schedule its gate_up one does: the same BLOCK_M
    block_m = {v: make_spec("moe", v, b.arch, "moe_gate_up_kernel", gate_up, {}, "any", overrides=b.ov("moe"),
                            defaults=DEFAULTS[v]).constexprs["BLOCK_M"] for v in ("gate_up", "gate_up_prefill")}
    rows = [
        ("router", "moe_router_kernel", router, {"H": h, "E": e, "DOT_PRECISION": sizes["DOT_PRECISION"]},
         ("BLOCK_T", "BLOCK_E")),
        ("router_small", "moe_router_kernel", router, {"H": h, "E": e, "DOT_PRECISION": sizes["DOT_PRECISION"]},
         ("BLOCK_T", "BLOCK_E", "max_tokens")),
        ("route", "moe_route_kernel", route, {"H": h, "E": e, "TOP_K": k, "E_PAD": pow2(e), "K_PAD": pow2(k),
                                               "HAS_SHARED": shared}, ()),
        # DeepSeek's routers compute float32 logits (HF casts both operands): the router kernel storing float32
        *([("router_deepseek", "moe_router_kernel", {**router, "logits_ptr": "*fp32"},
            {"H": h, "E": e, "DOT_PRECISION": sizes["DOT_PRECISION"]}, ("BLOCK_T", "BLOCK_E")),
           ("router_deepseek_small", "moe_router_kernel", {**router, "logits_ptr": "*fp32"},
            {"H": h, "E": e, "DOT_PRECISION": sizes["DOT_PRECISION"]}, ("BLOCK_T", "BLOCK_E", "max_tokens")),
           ("route_deepseek", "moe_route_deepseek_kernel", route_deepseek,
            {"E": e, "TOP_K": k, "E_PAD": pow2(e), "K_PAD": pow2(k), "G_PAD": pow2(e), "HAS_SHARED": shared},
            ())] if cfg.moe_scored_routing else []),
        ("gate_up", "moe_gate_up_kernel", gate_up, {**sizes, "TOP_K": k, "PAIR_ORDER": 0}, ("BLOCK_M", "BLOCK_N")),
        ("down", "moe_down_kernel", down, {**sizes, "BLOCK_M": block_m["gate_up"], "PAIR_ORDER": 0},
         ("BLOCK_M", "BLOCK_N")),
        ("gate_up_prefill", "moe_gate_up_kernel", gate_up, {**sizes, "TOP_K": k, "PAIR_ORDER": 0},
         ("BLOCK_M", "BLOCK_N", "prefill_min_rows")),
        ("down_prefill", "moe_down_kernel", down, {**sizes, "BLOCK_M": block_m["gate_up_prefill"], "PAIR_ORDER": 0},
         ("BLOCK_M", "BLOCK_N")),
        ("gate_up_decode", "moe_gate_up_route_kernel", gate_up_route,
         {"H": h, "INTER": inter, "E": e, "TOP_K": k, "E_PAD": pow2(e), "K_PAD": pow2(k), "FP8_W": fp8,
          "INT4_W": int4}, ("BLOCK_N", "max_pairs")) if fused["gate_up_decode"] else
        # unfused decode variants: one pair a program, in pair order (PAIR_ORDER: no row list to read)
        ("gate_up_decode", "moe_gate_up_kernel", gate_up, {**sizes, "TOP_K": k, "BLOCK_M": 1, "PAIR_ORDER": 1},
         ("BLOCK_N", "max_pairs")),
        ("down_decode", "moe_down_combine_kernel", down_combine,
         {"H": h, "INTER": inter, "TOP_K": k, "FP8_W": fp8, "INT4_W": int4}, ("BLOCK_N",)) if fused["down_decode"] else
        ("down_decode", "moe_down_kernel", down, {**sizes, "BLOCK_M": 1, "PAIR_ORDER": 1}, ("BLOCK_N",)),
        ("combine", "moe_combine_kernel", combine, {"H": h, "TOP_K": k, "HAS_SHARED": shared}, ("BLOCK",)),
        # one kernel for both grouped pairs: BLOCK_M is a runtime argument. RANK_BLOCK x E_PAD is the one-hot
        # a rank step holds: 4K elements (32 pairs of 128 experts) stay in registers, and a batch's pairs
        # spread over more programs (H200: 4.3 us at 256 pairs of 128 experts, 6.2 with 64)
        ("sort", "moe_sort_kernel", sort, {"E": e, "E_PAD": pow2(e),
                                           "RANK_BLOCK": max(16, min(128, 4096 // pow2(e)))},
         ("RANK_BLOCK", "max_programs")),
    ]
    specs = [make_spec("moe", variant, b.arch, fn, types, consts, "any", launch_keys=keys, overrides=b.ov("moe"),
                       defaults=DEFAULTS[variant])
             for variant, fn, types, consts, keys in rows]
    # launch constant "fused": the launch rules launch that decode variant as its fused kernel
    return [replace(s, launch={**s.launch, "fused": 1}) if fused.get(s.variant) else s for s in specs]
