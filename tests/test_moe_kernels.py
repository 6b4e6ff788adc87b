"""The MoE op's Triton kernels under TRITON_INTERPRET=1 against the torch reference (kernels/moe).

As in test_kernels.py, the checks run in one child process (this file as a script) with the interpreter on,
through the specs codegen builds for a small MoE model and the op's own launch rules and forward(), which is
what the GPU binding runs: the routing variants, the decode path (one (token, expert) pair a program) and the
grouped paths (pairs sorted by expert, padded to BLOCK_M: the decode-sized batches' small tile and the
prefill variants' large one; the sort kernel's schedule exactly sort_by_expert's), with and without a shared
expert, and both with the fp8 experts of engc build --quant fp8 (float8 weights, a scale per channel, inputs
quantized per row: the FP8_W specialization, W8A8). Without a shared expert the decode path can be fused where
the tune table says so (gate_up routing its own pairs, down summing each token's): bit for bit the unfused
kernels' for every routing, ties, and float, fp8 and int4 experts.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from interpreted import interpreted_report, print_report
from test_codegen import check_launch, launch_checker
from test_kernels import _rel, _run

ROOT = Path(__file__).resolve().parents[1]

CASES = ["route_softmax_fp32", "route_tiled_router_fp32", "route_softmax_renorm_fp32", "route_topk_first_fp32", "route_bf16",
         "route_float32_weights_bf16",
         "route_ties_pick_lower_ids", "decode_fp32", "decode_shared_fp32", "grouped_fp32", "grouped_shared_fp32",
         "grouped_bf16", "decode_bf16", "grouped_many_experts_fp32", "gpu_binding_fp32",
         "deepseek_v2_decode_fp32", "deepseek_v3_grouped_fp32",
         "deepseek_v2_lite_routing_fp32", "deepseek_v2_bf16", "ernie4_5_softmax_bias_bf16", "fp8_decode_bf16",
         "fp8_grouped_bf16",
         "fp8_decode_shared_fp32", "fp8_grouped_fp32", "fp8_deepseek_v3_grouped_bf16", "fp8_gpu_binding_bf16",
         "int4_decode_bf16", "int4_grouped_bf16", "int4_grouped_shared_fp32", "int4_prefill_fp32",
         "int4_whole_row_group_fp32", "prefill_fp32", "prefill_bf16", "prefill_shared_fp32", "prefill_many_blocks_fp32",
         "below_prefill_threshold_fp32", "fp8_prefill_fp32",
         "sort_one_token", "sort_grouped", "sort_mostly_empty_experts", "sort_all_on_one_expert",
         "sort_prefill_block", "sort_pow2_experts", "sort_many_programs", "sort_one_program_loops"]


@pytest.fixture(scope="module")
def report():
    return interpreted_report(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_moe_kernel_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


def test_op_contract_does_not_import_triton():
    import subprocess
    code = ("import sys, engc.kernels.moe; assert 'engc.kernels.moe.launch' not in sys.modules; "
            "import engc.kernels.moe.bind; assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_specs_only_for_moe_models():
    import torch
    from engc.compiler.codegen.specs import model_specs
    dense = [s.op for s in model_specs(_cfg(num_experts=0), torch.bfloat16, "sm90", 16)]
    assert "moe" not in dense
    variants = {s.variant for s in model_specs(_cfg(), torch.bfloat16, "sm90", 16) if s.op == "moe"}
    assert variants == {"router", "router_small", "route", "gate_up", "down", "gate_up_prefill", "down_prefill", "gate_up_decode",
                        "down_decode", "combine", "sort"}


GEMMS = ("gate_up", "down", "gate_up_prefill", "down_prefill", "gate_up_decode", "down_decode")


def test_grouped_variants_follow_the_token_count():
    """The launch rule's choice: decode up to max_pairs pairs, prefill from prefill_min_rows pairs an expert on
    average (Qwen3-30B-A3B's shape: 128 experts, top-8), the small-tile grouped pair between; a bundle
    without the prefill variants keeps the grouped pair."""
    from engc.kernels.moe.launch import grouped_variants
    from engc.kernels.moe.specs import DEFAULTS
    consts = {v: DEFAULTS[v] for v in ("gate_up_decode", "gate_up_prefill")}
    min_rows = DEFAULTS["gate_up_prefill"]["prefill_min_rows"]
    assert grouped_variants(8, 8, 128, consts) is None
    assert grouped_variants(256, 8, 128, consts) == ("gate_up", "down")
    assert grouped_variants(min_rows * 16 - 1, 8, 128, consts) == ("gate_up", "down")
    assert grouped_variants(min_rows * 16, 8, 128, consts) == ("gate_up_prefill", "down_prefill")
    assert grouped_variants(4096, 8, 128, {"gate_up_decode": consts["gate_up_decode"]}) == ("gate_up", "down")


@pytest.mark.parametrize("fused", ["", "gate_up_decode", "down_decode", "gate_up_decode,down_decode"])
@pytest.mark.parametrize("family,attrs", [
    ("qwen3_moe", dict(renormalize=1)),
    ("mixtral", dict(renormalize=1, float32_weights=1)),
    ("olmoe", {}),
    ("qwen2_moe", dict(has_shared_expert=1)),
    ("deepseek_v3", dict(has_shared_expert=1, shared_ungated=1, sigmoid_scores=1, n_group=2, topk_group=1,
                         routed_scaling_factor=2.5))])
def test_decode_launches_of_each_routing(family, attrs, fused):
    """What forward() passes to run, counted, with the decode fusions the tune table turns on (field "fused" of
    the decode variants, each set here): a routing without a shared expert (Qwen3-MoE, Mixtral, OLMoE) drops the
    route launch where gate_up routes its own pairs and the combine where down sums each token's pairs (three
    launches with both, five with neither), at one token and at a few; a shared expert (Qwen2-MoE) keeps the
    route and the combine, DeepSeek its routing kernel and the combine, whatever the table says; past max_pairs
    every model routes, sorts and combines."""
    import torch
    from engc.compiler import tune
    from engc.compiler.codegen.specs import model_specs
    from engc.kernels.moe import launch as gpu
    shared = 40 if attrs.get("has_shared_expert") else 0
    cfg = _cfg(family=family, shared_expert_intermediate_size=shared, num_experts=4 if shared else 6)
    chosen = set(fused.split(",")) - {""}
    on = chosen if not shared else set()
    with tune.overridden({f"sm90/moe/{v}/any": {"fused": int(v in chosen)} for v in ("gate_up_decode", "down_decode")}):
        consts = {s.variant: s.launch for s in model_specs(cfg, torch.bfloat16, "sm90", 16) if s.op == "moe"}
    assert {v for v in ("gate_up_decode", "down_decode") if consts[v].get("fused")} == on
    router = "router_deepseek_small" if family.startswith("deepseek") else "router_small"
    route = "route_deepseek" if family.startswith("deepseek") else "route"
    decode = [router, *([] if "gate_up_decode" in on else [route]), "gate_up_decode", "down_decode",
              *([] if "down_decode" in on else ["combine"])]
    e, bf = cfg.num_experts, torch.bfloat16
    inputs = [torch.randn(e, 64, dtype=bf), torch.randn(e, 96, 64, dtype=bf), torch.randn(e, 64, 48, dtype=bf)]
    if shared:
        inputs += [torch.randn(2 * shared, 64, dtype=bf), torch.randn(64, shared, dtype=bf)]
        inputs += [] if attrs.get("shared_ungated") else [torch.randn(1, 64, dtype=bf)]

    def launched(tokens):
        seen = []
        gpu.forward(lambda launches: seen.extend(v for v, _, _ in launches), torch.randn(tokens, 64, dtype=bf),
                    *inputs, top_k=2, consts=consts, **attrs)
        return seen
    assert launched(1) == decode and launched(4) == decode
    most = consts["gate_up_decode"]["max_pairs"] // 2   # tokens of top-2 on the decode path (past the small router)
    assert launched(most)[1:] == decode[1:]
    grouped = launched(most + 1)
    assert grouped[1:] == [route, "sort", "gate_up", "down", "combine"], grouped


def test_moe_kernels_take_pdl_only_where_the_tune_table_turns_it_on():
    """Every MoE kernel is written for programmatic dependent launch (the PDL constexpr); on sm90 the table keeps
    it off until a step A/B turns an entry on, and an entry's PDL 1 reaches that kernel's compiled constant and
    its record's launch constant alone."""
    import torch
    from engc.compiler import tune
    from engc.compiler.codegen.specs import model_specs
    cfg = _cfg()
    specs = [s for s in model_specs(cfg, torch.bfloat16, "sm90", 16) if s.op == "moe"]
    assert specs and all(s.constexprs["PDL"] == 0 == s.launch["PDL"] for s in specs)
    with tune.overridden({"sm90/moe/gate_up_decode/any": {"PDL": 1}}):
        on = {s.variant: (s.constexprs["PDL"], s.launch["PDL"]) for s in model_specs(cfg, torch.bfloat16, "sm90", 16)
              if s.op == "moe"}
    assert {v for v, flags in on.items() if any(flags)} == {"gate_up_decode"} and on["gate_up_decode"] == (1, 1)


@pytest.mark.parametrize("shared,fp8", [(0, False), (40, False), (0, True), (40, True)],
                         ids=["routed", "shared-expert", "fp8-experts", "fp8-experts-shared"])
def test_moe_kernels_compile_for_sm80_and_sm90_and_match_the_launch_rules(shared, fp8):
    """Every MoE kernel compiles ahead of time for both archs (no GPU), and each launch forward() makes, on
    both paths, passes the compiled kernel's parameters in order, with the recorded types. fp8 experts: sm90
    only (--quant fp8 refuses archs without FP8 support, sm80 among them: test_moe.py), float8 weight
    pointers, float32 scales, the grouped GEMMs' dots float8 x float8 wgmma."""
    import torch
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from engc.kernels.moe import launch as gpu
    cfg = _cfg(shared_expert_intermediate_size=shared)
    archs = ("sm90",) if fp8 else ("sm80", "sm90")
    specs = [s for arch in archs for s in model_specs(cfg, torch.bfloat16, arch, 16, quant="fp8" if fp8 else "none")
             if s.op == "moe" or (s.op == "fp8_quant" and s.variant in ("k64", "k48"))]   # x's and act's widths
    result = compile_specs(specs, jobs=1)
    records = {(r["arch"], r["variant"]): r for r in result.records}
    quant = {("sm90", "k64"), ("sm90", "k48")} if fp8 else set()
    assert set(records) == {(a, v) for a in archs for v in GEMMS + ("router", "router_small", "route", "combine",
                                                                    "sort")} | quant
    for r in result.records:
        if r["op"] != "moe":
            continue
        ptx = result.files[r["ptx"]].decode()
        assert result.files[r["cubin"]][:4] == b"\x7fELF" and f".entry {r['entry']}(" in ptx
        if r["variant"] in GEMMS:
            w_type = {a["name"]: a["type"] for a in r["args"]}["w_ptr"]
            assert w_type == ("*fp8e4nv" if fp8 else "*bf16")
            assert ("e4m3" in ptx) == fp8   # the codes' conversion, only in the fp8 specialization
            if fp8 and "decode" not in r["variant"]:   # W8A8: the grouped dots on the FP8 tensor cores
                assert ".f32.e4m3.e4m3" in ptx and "wgmma" in ptx, r["variant"]
    consts = {v: r["launch"] for (a, v), r in records.items() if a == "sm90"}
    check = launch_checker(records, stand_in=_routing_stand_in)

    bf = torch.bfloat16
    w = dict(router=torch.randn(6, 64, dtype=bf), gate_up=torch.randn(6, 96, 64, dtype=bf),
             down=torch.randn(6, 64, 48, dtype=bf))
    extra = ()
    if fp8:
        w["gate_up"], w["down"] = w["gate_up"].to(torch.float8_e4m3fn), w["down"].to(torch.float8_e4m3fn)
        extra += (torch.rand(6, 96), torch.rand(6, 64))
    # down walks gate_up's schedule: each grouped pair's BLOCK_M is one
    assert records[("sm90", "down")]["launch"]["BLOCK_M"] == records[("sm90", "gate_up")]["launch"]["BLOCK_M"]
    assert records[("sm90", "down_prefill")]["launch"]["BLOCK_M"] == \
        records[("sm90", "gate_up_prefill")]["launch"]["BLOCK_M"]
    # the decode path, the grouped one, the prefill one (past prefill_min_rows pairs an expert of the 6)
    prefill = records[("sm90", "gate_up_prefill")]["launch"]["prefill_min_rows"] * 6 // 2 + 8
    for tokens in (3, 80, prefill):
        # the shared expert's output (the program's dense MLP) and its gate
        shared_in = (torch.randn(tokens, 64, dtype=bf), torch.randn(1, 64, dtype=bf)) if shared else ()
        gpu.forward(check, torch.randn(tokens, 64, dtype=bf), w["router"], w["gate_up"], w["down"], *shared_in,
                    *extra, top_k=2, consts=consts, quant=check, has_shared_expert=int(bool(shared)),
                    fp8_experts=int(fp8))
    assert check.seen == {v for a, v in records if a == "sm90"}


def _routing_stand_in(variant, args):
    """The route kernel's stand-in for the launch checks: a routing (every weight 0.5, experts in turn) the
    schedule can be made from."""
    import torch
    if variant == "route":
        args[3].fill_(0.5)
        args[4].copy_(torch.arange(args[4].numel()).reshape(args[4].shape) % 6)


def test_int4_expert_kernels_compile_for_sm80_and_sm90_and_match_the_launch_rules():
    """int4 experts (the INT4_W specialization, groups of 32): the expert GEMMs compile for both archs with
    int32 packed weights, model-dtype scales and uint8 zero points, and every launch forward() makes on the
    decode, grouped and prefill paths passes the compiled kernel's parameters in order."""
    import torch
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from engc.kernels.moe import launch as gpu
    cfg = _cfg(moe_intermediate_size=64)
    specs = [s for arch in ("sm80", "sm90") for s in model_specs(cfg, torch.bfloat16, arch, 16, int4_experts=32)
             if s.op == "moe"]
    result = compile_specs(specs, jobs=1)
    records = {(r["arch"], r["variant"]): r for r in result.records}
    for r in result.records:
        if r["variant"] in GEMMS:
            types = {a["name"]: a["type"] for a in r["args"]}
            assert (types["w_ptr"], types["w_scale_ptr"], types["w_zero_ptr"]) == ("*i32", "*bf16", "*u8")
    consts = {v: r["launch"] for (a, v), r in records.items() if a == "sm90"}
    check = launch_checker(records, stand_in=_routing_stand_in)

    bf = torch.bfloat16
    packed = (torch.zeros(6, 128, 8, dtype=torch.int32), torch.zeros(6, 64, 8, dtype=torch.int32))
    int4 = (torch.ones(6, 128, 2, dtype=bf), torch.zeros(6, 128, 2, dtype=torch.uint8),
            torch.ones(6, 64, 2, dtype=bf), torch.zeros(6, 64, 2, dtype=torch.uint8))
    prefill = records[("sm90", "gate_up_prefill")]["launch"]["prefill_min_rows"] * 6 // 2 + 8
    for tokens in (3, 80, prefill):
        gpu.forward(check, torch.randn(tokens, 64, dtype=bf), torch.randn(6, 64, dtype=bf), *packed, *int4, top_k=2,
                    consts=consts, group_size=32)
    assert check.seen == {v for a, v in records if a == "sm90"}


def test_deepseek_routing_kernel_compiles_and_matches_its_launch_rule():
    """DeepSeek's routing kernels (only in a DeepSeek bundle: the float32-logits router and the routing) compile
    for sm80 and sm90, and forward() launches them, with the node's routing attributes and correction bias, in
    the compiled parameters' order and types."""
    import torch
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from engc.kernels.moe import launch as gpu
    deepseek = {"router_deepseek", "router_deepseek_small", "route_deepseek"}
    assert not deepseek & {s.variant for s in model_specs(_cfg(), torch.bfloat16, "sm90", 16)}
    cfg = _cfg(family="deepseek_v3", num_experts=8, shared_expert_intermediate_size=40)
    specs = [s for arch in ("sm80", "sm90") for s in model_specs(cfg, torch.bfloat16, arch, 16)
             if s.op == "moe" and s.variant in deepseek]
    result = compile_specs(specs, jobs=1)
    assert {(r["arch"], r["variant"]) for r in result.records} == {(a, v) for a in ("sm80", "sm90") for v in deepseek}
    records = {r["variant"]: r for r in result.records if r["arch"] == "sm90"}
    x, logits = torch.randn(3, 64, dtype=torch.bfloat16), torch.empty(3, 8)
    consts = {s.variant: s.launch for s in specs if s.arch == "sm90"}
    for tokens, expected in ((3, "router_deepseek_small"), (40, "router_deepseek")):   # decode's few, prefill's many
        (variant, grid, args), = gpu.launch_router(torch.randn(tokens, 64, dtype=torch.bfloat16),
                                                   torch.randn(8, 64, dtype=torch.bfloat16), torch.empty(tokens, 8),
                                                   consts, "router_deepseek")
        assert variant == expected
        check_launch(grid, args, records[variant], null_pointers=False)
    launches = gpu.launch_route_deepseek(x, logits, torch.randn(8),
                                         torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int32), torch.empty(3),
                                         renormalize=1, float32_weights=0, sigmoid_scores=1, n_group=4,
                                         topk_group=2, group_top2=1, routed_scaling_factor=2.5)
    (variant, grid, args), = launches
    assert variant == "route_deepseek" and grid == (3, 1, 1)
    check_launch(grid, args, records[variant], null_pointers=False)


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _cfg(**kw):
    from engc.bundle.model_config import ModelConfig
    base = dict(family="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=512, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=48, shared_expert_intermediate_size=0)
    base.update(kw)
    # the frontend's fact for DeepSeek's routings (frontend/moe.py expert_counts)
    base.setdefault("moe_scored_routing", base["family"].startswith("deepseek"))
    return ModelConfig(**base)


def _specs(cfg, dtype, overrides=None, fp8=False, int4=0):
    """The MoE op's specs by variant, and with fp8 experts the fp8_quant ones that quantize their inputs (their
    variant names, k<width>, are none of the MoE op's); int4: the experts' group size."""
    from engc.compiler.codegen.specs import model_specs
    return {s.variant: s for s in model_specs(cfg, dtype, "sm90", 16, {"moe": overrides} if overrides else None,
                                              quant="fp8" if fp8 else "none", int4_experts=int4)
            if s.op in ("moe", "fp8_quant")}


def _runner(specs):
    """test_kernels' _run (launch-rule output through the interpreter, as the runtime launches it), recording
    the variants it ran."""
    def run(launches):
        launches = list(launches)
        _run(specs, launches)
        run.variants += [variant for variant, _, _ in launches]
    run.variants = []
    return run


def _weights(cfg, dtype, seed=0, shared=0, fp8=False, int4=0):
    """Random weights; fp8: the experts float8 and their scales as engc build --quant fp8 makes them, each
    channel's scale spread over two decades (a kernel that dropped or misplaced one would be far off)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    r = lambda *s, std=0.3: (torch.randn(*s, generator=g) * std).to(dtype)  # noqa: E731
    w = dict(router=r(e, h), gate_up=r(e, 2 * i, h, std=0.15), down=r(e, h, i, std=0.15))
    if shared:
        w.update(shared_gate_up=r(2 * shared, h, std=0.15), shared_down=r(h, shared, std=0.15), shared_gate=r(1, h))
    if fp8:
        from engc.compiler.passes.quantize_fp8 import _quantize_experts_rows
        for name in ("gate_up", "down"):
            spread = torch.logspace(-1, 1, w[name].shape[1])[torch.randperm(w[name].shape[1], generator=g)]
            w[name], w[name + "_scale"] = _quantize_experts_rows(w[name].float() * spread[:, None])
    if int4:   # the engc int4 layout: every code, zero point and (spread) scale drawn at random
        from engc.kernels.int4_linear.layout import pack_int4
        for name in ("gate_up", "down"):
            e_, n, k = w[name].shape
            q = torch.randint(0, 16, (e_, n, k), generator=g, dtype=torch.uint8)
            w[name] = torch.stack([pack_int4(q[i]) for i in range(e_)])
            w[name + "_zeros"] = torch.randint(0, 16, (e_, n, -(-k // int4)), generator=g, dtype=torch.uint8)
            w[name + "_scales"] = (torch.rand(e_, n, -(-k // int4), generator=g) * 0.02 + 0.002).to(dtype)
    return w, r


def _shared_inputs(w, x, gated: bool = True) -> list:
    """The node's shared-expert inputs: the shared expert's output on x (the program's dense MLP computes it),
    and Qwen2-MoE's gate."""
    from engc.kernels.moe import glu
    return [glu(x, w["shared_gate_up"], w["shared_down"])] + ([w["shared_gate"]] if gated else [])


def _quant_inputs(w) -> list:
    """The node's fp8 or int4 inputs (after the shared expert's), absent for float experts."""
    if "gate_up_zeros" in w:
        return [w["gate_up_scales"], w["gate_up_zeros"], w["down_scales"], w["down_zeros"]]
    return [w["gate_up_scale"], w["down_scale"]] if "gate_up_scale" in w else []


def check_route(dtype, softmax_first, renormalize, ties=False, float32_weights=0, tokens=13):
    """The router and routing kernels against route(): 13 tokens take the small router, 40 the tiled one."""
    import torch
    from engc.kernels import moe as op
    from engc.kernels.moe import launch as gpu
    cfg = _cfg(num_experts=10, num_experts_per_tok=3)
    specs = _specs(cfg, dtype)
    w, r = _weights(cfg, dtype)
    x = r(tokens, 64, std=1.0)
    router = torch.zeros_like(w["router"]) if ties else w["router"]
    weights = torch.full((tokens, 3), float("nan"))
    ids = torch.full((tokens, 3), -7, dtype=torch.int32)
    logits = torch.full((tokens, 10), float("nan")).to(dtype)
    run = _runner(specs)
    run(gpu.launch_router(x, router, logits, {v: s.launch for v, s in specs.items()}))
    run(gpu.launch_route(x, logits, router, weights, ids, weights, softmax_first, renormalize, float32_weights))
    assert run.variants[0] == ("router_small" if tokens <= 16 else "router"), run.variants
    if ties:   # every score equal: the kernel takes the lowest expert ids, in order
        ok = (ids == torch.arange(3, dtype=torch.int32)).all() and torch.allclose(weights, torch.full_like(weights, 0.1 if not renormalize else 1 / 3))
        return 0.0 if ok else float("inf")
    ref_w, ref_ids = op.route(x, router, 3, softmax_first, renormalize)
    if not torch.equal(ids.long(), ref_ids):
        return float("inf")
    if float32_weights and torch.equal(weights, weights.to(dtype).float()):
        return float("inf")   # Mixtral's weights must keep float32's bits, not the model dtype's
    return _rel(weights, ref_w if float32_weights else ref_w.to(dtype))


def check_forward(dtype, tokens, shared=0, max_pairs=64, experts=6, top_k=2, softmax_first=1, renormalize=0,
                  fp8=False, min_rows=10 ** 6, int4=0):
    """forward() against the reference; min_rows: the prefill variants' prefill_min_rows (by default out of
    reach, so a grouped case stays on the small-tile pair)."""
    from engc.kernels import moe as op
    from engc.kernels.moe import launch as gpu
    # int4: the layout packs 32 inputs a chunk, so the experts' width is 64 there
    cfg = _cfg(num_experts=experts, num_experts_per_tok=top_k, shared_expert_intermediate_size=shared,
               **({"moe_intermediate_size": 64} if int4 else {}))
    specs = _specs(cfg, dtype, {"max_pairs": max_pairs, "prefill_min_rows": min_rows, "BLOCK_N": 32, "BLOCK_K": 32},
                   fp8=fp8, int4=int4)
    assert specs["gate_up_prefill"].constexprs["BLOCK_M"] > specs["gate_up"].constexprs["BLOCK_M"]
    w, r = _weights(cfg, dtype, seed=tokens, shared=shared, fp8=fp8, int4=int4)
    x = r(tokens, cfg.hidden_size, std=1.0)
    attrs = dict(top_k=top_k, softmax_first=softmax_first, renormalize=renormalize, has_shared_expert=int(bool(shared)),
                 **({"fp8_experts": 1} if fp8 else {}), **({"group_size": int4} if int4 else {}))
    inputs = [x, w["router"], w["gate_up"], w["down"], *(_shared_inputs(w, x) if shared else []), *_quant_inputs(w)]
    ref = op.moe(*inputs, **attrs)
    run = _runner(specs)
    consts = {v: s.launch for v, s in specs.items()}
    out = gpu.forward(run, *inputs, consts=consts, quant=run, **attrs)
    pairs = tokens * top_k
    kind = "_decode" if pairs <= max_pairs else "_prefill" if pairs >= min_rows * experts else ""
    router = "router_small" if tokens <= specs["router_small"].launch["max_tokens"] else "router"
    quant_x, quant_act = ([f"k{cfg.hidden_size}"], [f"k{cfg.moe_intermediate_size}"]) if fp8 else ([], [])
    # the table's decode gate_up may route its own pairs (tune field "fused"; never with a shared expert)
    routes = kind != "_decode" or not specs["gate_up_decode"].launch.get("fused")
    expected = [router, *(["route"] if routes else []), *([] if kind == "_decode" else ["sort"]), *quant_x,
                "gate_up" + kind, *quant_act, "down" + kind, "combine"]
    assert run.variants == expected, run.variants
    return _rel(out, ref), run.variants


def check_fused_decode(dtype, tokens, top_k=2, softmax_first=1, renormalize=0, float32_weights=0, fp8=False, int4=0,
                       ties=False):
    """The fused decode path of a routing without a shared expert (gate_up routing its pairs itself, down summing
    each token's pairs) against the same model's unfused decode kernels (route, gate_up, down, combine: the
    decode variants a shared-expert model compiles, which take the same constexprs) bit for bit, and against
    the reference. ties: expert 3 a copy of expert 0 (router row and weights), both a clear second to expert
    1 (x's first input 1, their router's first column 2 against its 3), so the two equal logits straddle the
    top-2 boundary of every token: the kernels take expert 0, and either choice is the reference's output."""
    import torch
    from engc.kernels import moe as op
    from engc.kernels.moe import launch as gpu
    cfg = _cfg(num_experts=6, num_experts_per_tok=top_k, **({"moe_intermediate_size": 64} if int4 else {}))
    tiles = {"BLOCK_N": 32, "BLOCK_K": 32}
    fused = _specs(cfg, dtype, {**tiles, "fused": 1}, fp8=fp8, int4=int4)   # both decode fusions on
    unfused = _specs(cfg, dtype, {**tiles, "fused": 0}, fp8=fp8, int4=int4)
    assert fused["gate_up_decode"].launch["fused"] and fused["down_decode"].launch["fused"]
    assert not {"fused"} & (set(unfused["gate_up_decode"].launch) | set(unfused["down_decode"].launch))
    w, r = _weights(cfg, dtype, seed=tokens + 100 * top_k, fp8=fp8, int4=int4)
    x = r(tokens, cfg.hidden_size, std=1.0)
    if ties:
        w["router"] = r(6, cfg.hidden_size, std=0.01)
        w["router"][:, 0] = torch.tensor([2.0, 3.0, -1.0, 2.0, 0.0, -2.0])
        x[:, 0] = 1.0
        for name in ("router", "gate_up", "down", "gate_up_scale", "down_scale", "gate_up_scales", "gate_up_zeros",
                     "down_scales", "down_zeros"):
            if name in w:
                w[name][3] = w[name][0]
    attrs = dict(top_k=top_k, softmax_first=softmax_first, renormalize=renormalize, has_shared_expert=0,
                 **({"float32_weights": 1} if float32_weights else {}), **({"fp8_experts": 1} if fp8 else {}),
                 **({"group_size": int4} if int4 else {}))
    inputs = [x, w["router"], w["gate_up"], w["down"], *_quant_inputs(w)]
    ref = op.moe(*inputs, **attrs)
    outs, routing = {}, {}
    for name, specs in (("fused", fused), ("unfused", unfused)):
        ran = _runner(specs)

        def run(launches, ran=ran, name=name):
            launches = list(launches)
            ran(launches)
            for variant, _, args in launches:   # the routing the down GEMM reads: (weights, ids)
                if variant == "route" or (name == "fused" and variant == "gate_up_decode"):
                    routing[name] = (args[3], args[4]) if variant == "route" else (args[6], args[7])
        outs[name] = gpu.forward(run, *inputs, consts={v: s.launch for v, s in specs.items()}, quant=run, **attrs)
        outs[name + "_launches"] = [v for v in ran.variants if not v.startswith("k")]   # the MoE op's
    assert outs["fused_launches"] == ["router_small", "gate_up_decode", "down_decode"], outs["fused_launches"]
    assert outs["unfused_launches"] == ["router_small", "route", "gate_up_decode", "down_decode", "combine"], \
        outs["unfused_launches"]
    assert all(torch.equal(a, b) for a, b in zip(routing["fused"], routing["unfused"])), routing
    if ties:   # expert 1 first, then the tie's lower id in both paths
        assert torch.equal(routing["fused"][1][:, :2], torch.tensor([[1, 0]] * tokens, dtype=torch.int32)), routing
    if not torch.equal(outs["fused"], outs["unfused"]):
        return float("inf"), [float((outs["fused"] - outs["unfused"]).abs().max())]
    return _rel(outs["fused"], ref), outs["fused_launches"]


def check_deepseek(dtype, tokens, v3: bool, max_pairs=64, fp8=False, groups=True, softmax_bias=False):
    """DeepSeek's routings (groups, scaling; V3's sigmoid scores and correction bias; V2-Lite's plain softmax
    top-k in float32 without groups) with ungated shared experts through forward(): the routing kernel of
    DeepSeek's, the same expert and combine kernels. softmax_bias: ERNIE 4.5's softmax scores with a correction
    bias, renormalized, no groups."""
    import torch
    from engc.kernels import moe as op
    from engc.kernels.moe import launch as gpu
    cfg = _cfg(family="deepseek_v3" if v3 else "deepseek_v2", num_experts=8, num_experts_per_tok=2,
               shared_expert_intermediate_size=40)
    specs = _specs(cfg, dtype, {"max_pairs": max_pairs, "BLOCK_N": 32, "BLOCK_K": 32}, fp8=fp8)
    w, r = _weights(cfg, dtype, seed=tokens, shared=40, fp8=fp8)
    x = r(tokens, cfg.hidden_size, std=1.0)
    attrs = dict(top_k=2, num_experts=8, has_shared_expert=1, shared_ungated=1,
                 routed_scaling_factor=2.5 if v3 else 1.5 if groups else 1.0,
                 **({"n_group": 4, "topk_group": 2} if groups else {}), **({"fp8_experts": 1} if fp8 else {}))
    extra = _quant_inputs(w)
    if v3:
        attrs.update(sigmoid_scores=1, correction_bias=1, group_top2=1, renormalize=1)
    if softmax_bias:
        attrs.update(correction_bias=1, renormalize=1, routed_scaling_factor=1.0)
    if v3 or softmax_bias:
        extra += [torch.randn(8, generator=torch.Generator().manual_seed(1)) * 0.05]
    inputs = [x, w["router"], w["gate_up"], w["down"], *_shared_inputs(w, x, gated=False), *extra]
    ref = op.moe(*inputs, **attrs)
    run = _runner(specs)
    out = gpu.forward(run, *inputs, consts={v: s.launch for v, s in specs.items()}, quant=run, **attrs)
    assert run.variants[:2] == ["router_deepseek_small" if tokens <= 16 else "router_deepseek", "route_deepseek"], \
        run.variants
    return _rel(out, ref), run.variants


def check_sort(tokens, top_k, experts, block_m, ids=None, overrides=None):
    """launch_sort's kernel against sort_by_expert, exactly: every row and block (the outputs start as garbage,
    so one the kernel leaves unwritten shows). ids: random distinct experts a token by default."""
    import torch
    from engc.kernels.moe import launch as gpu
    specs = _specs(_cfg(num_experts=experts, num_experts_per_tok=top_k), torch.float32, overrides)
    if ids is None:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    blocks = gpu.sort_blocks(ids.numel(), experts, block_m)
    rows = torch.full((blocks * block_m,), -7, dtype=torch.int32)
    block_expert = torch.full((blocks,), -7, dtype=torch.int32)
    launches = gpu.launch_sort(ids, rows, block_expert, block_m, {v: s.launch for v, s in specs.items()})
    _runner(specs)(launches)
    ref_rows, ref_blocks = gpu.sort_by_expert(ids, experts, block_m)
    ok = torch.equal(rows, ref_rows) and torch.equal(block_expert, ref_blocks)
    return 0.0 if ok else float("inf"), [grid for _, grid, _ in launches]


def check_binding(dtype, fp8=False):
    """bind.py's GPU op as the executor calls it (the node's inputs and every attribute the frontend and the
    fp8 pass write), its kernels run by a stand-in for the runtime's context."""
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels.moe import bind
    cfg = _cfg(shared_expert_intermediate_size=24)
    specs = _specs(cfg, dtype, {"BLOCK_N": 32, "BLOCK_K": 32}, fp8=fp8)

    class Context:
        def __init__(self):
            self.ran = _runner(specs)

        def run(self, name, launches):
            assert name in (("moe", "fp8_quant") if fp8 else ("moe",)), name
            self.ran(launches)

        def has(self, name):
            return name in (("moe", "fp8_quant") if fp8 else ("moe",))

        def consts(self, name):
            return {v: s.launch for v, s in specs.items()}

    ctx = Context()
    w, r = _weights(cfg, dtype, seed=3, shared=24, fp8=fp8)
    x = r(5, cfg.hidden_size, std=1.0)
    inputs = [x, w["router"], w["gate_up"], w["down"], *_shared_inputs(w, x), *_quant_inputs(w)]
    attrs = dict(num_experts=6, top_k=2, softmax_first=1, renormalize=0, has_shared_expert=1,
                 **({"fp8_experts": True} if fp8 else {}))
    (out,) = bind.gpu_ops(ctx)[(ENGC_DOMAIN, "MoE")](*inputs, **attrs)
    (ref,) = bind.CPU_OPS[(ENGC_DOMAIN, "MoE")](*inputs, **attrs)
    return _rel(out, ref), ctx.ran.variants


def main():
    import torch
    f32, bf16 = torch.float32, torch.bfloat16
    # the interpreter's float -> bf16 conversions truncate where the GPU's round to nearest, and the op rounds
    # six times on the way (gate, up, silu, product, expert output, weighted): bf16 gets that much room; the
    # float32 cases check the arithmetic itself
    tol = {f32: 1e-5, bf16: 4e-2}
    checks = {
        "route_softmax_fp32": (lambda: check_route(f32, 1, 0), 1e-6),
        "route_tiled_router_fp32": (lambda: check_route(f32, 1, 0, tokens=40), 1e-6),
        "route_softmax_renorm_fp32": (lambda: check_route(f32, 1, 1), 1e-6),
        "route_topk_first_fp32": (lambda: check_route(f32, 0, 0), 1e-6),
        "route_bf16": (lambda: check_route(bf16, 1, 1), tol[bf16]),
        "route_float32_weights_bf16": (lambda: check_route(bf16, 1, 1, float32_weights=1), tol[bf16]),
        "route_ties_pick_lower_ids": (lambda: check_route(f32, 1, 0, ties=True), 0),
        "decode_fp32": (lambda: check_forward(f32, 3), tol[f32]),
        "decode_shared_fp32": (lambda: check_forward(f32, 2, shared=40, renormalize=1), tol[f32]),
        "grouped_fp32": (lambda: check_forward(f32, 37, max_pairs=4), tol[f32]),
        "grouped_shared_fp32": (lambda: check_forward(f32, 21, shared=40, max_pairs=4, softmax_first=0), tol[f32]),
        "grouped_bf16": (lambda: check_forward(bf16, 29, max_pairs=4, renormalize=1), tol[bf16]),
        "decode_bf16": (lambda: check_forward(bf16, 4, shared=24), tol[bf16]),
        # more experts than pairs: most experts get no rows, the schedule's tail blocks are padding
        "grouped_many_experts_fp32": (lambda: check_forward(f32, 9, experts=32, top_k=4, max_pairs=4), tol[f32]),
        "gpu_binding_fp32": (lambda: check_binding(f32), tol[f32]),
        # the fused decode path (no shared expert: three launches) bit for bit the unfused kernels', and near
        # the reference: Qwen3-MoE (softmax, top-k, renormalized), OLMoE (not renormalized), Mixtral's
        # top-k-then-softmax and float32 weights, equal logits at the top-k boundary, one token and a few,
        # float, fp8 and int4 experts
        "fused_qwen3_one_token_bf16": (lambda: check_fused_decode(bf16, 1, top_k=4, renormalize=1), tol[bf16]),
        "fused_qwen3_fp32": (lambda: check_fused_decode(f32, 5, top_k=4, renormalize=1), tol[f32]),
        "fused_olmoe_bf16": (lambda: check_fused_decode(bf16, 3), tol[bf16]),
        "fused_olmoe_one_token_fp32": (lambda: check_fused_decode(f32, 1), tol[f32]),
        "fused_mixtral_topk_first_fp32": (lambda: check_fused_decode(f32, 4, softmax_first=0), tol[f32]),
        "fused_mixtral_float32_weights_bf16": (lambda: check_fused_decode(bf16, 4, renormalize=1, float32_weights=1),
                                               tol[bf16]),
        "fused_mixtral_float32_weights_one_token_bf16": (
            lambda: check_fused_decode(bf16, 1, softmax_first=0, float32_weights=1), tol[bf16]),
        "fused_ties_fp32": (lambda: check_fused_decode(f32, 3, renormalize=1, ties=True), tol[f32]),
        "fused_ties_bf16": (lambda: check_fused_decode(bf16, 1, ties=True), tol[bf16]),
        "fused_fp8_bf16": (lambda: check_fused_decode(bf16, 3, renormalize=1, fp8=True), tol[bf16]),
        "fused_fp8_one_token_fp32": (lambda: check_fused_decode(f32, 1, top_k=4, fp8=True), tol[f32]),
        "fused_fp8_ties_bf16": (lambda: check_fused_decode(bf16, 2, ties=True, fp8=True), tol[bf16]),
        "fused_int4_bf16": (lambda: check_fused_decode(bf16, 3, renormalize=1, int4=32), tol[bf16]),
        "fused_int4_one_token_fp32": (lambda: check_fused_decode(f32, 1, softmax_first=0, int4=32), tol[f32]),
        "fused_int4_ties_bf16": (lambda: check_fused_decode(bf16, 4, ties=True, int4=32), tol[bf16]),
        "deepseek_v2_decode_fp32": (lambda: check_deepseek(f32, 5, v3=False), tol[f32]),
        "deepseek_v3_grouped_fp32": (lambda: check_deepseek(f32, 23, v3=True, max_pairs=4), tol[f32]),
        "deepseek_v2_lite_routing_fp32": (lambda: check_deepseek(f32, 7, v3=False, groups=False), tol[f32]),
        "deepseek_v2_bf16": (lambda: check_deepseek(bf16, 6, v3=False), tol[bf16]),
        "ernie4_5_softmax_bias_bf16": (lambda: check_deepseek(bf16, 6, v3=False, groups=False, softmax_bias=True),
                                       tol[bf16]),
        # fp8 experts (W8A8): bf16 activations as an fp8 bundle has them, quantized per row inside the
        # kernels as the reference quantizes them (the same codes: only the sums' order differs, so bf16's
        # room is the same); float32 checks the scales' arithmetic itself
        "fp8_decode_bf16": (lambda: check_forward(bf16, 4, fp8=True), tol[bf16]),
        "fp8_grouped_bf16": (lambda: check_forward(bf16, 29, max_pairs=4, renormalize=1, fp8=True), tol[bf16]),
        "fp8_decode_shared_fp32": (lambda: check_forward(f32, 3, shared=40, fp8=True), tol[f32]),
        "fp8_grouped_fp32": (lambda: check_forward(f32, 9, experts=32, top_k=4, max_pairs=4, fp8=True), tol[f32]),
        "fp8_deepseek_v3_grouped_bf16": (lambda: check_deepseek(bf16, 23, v3=True, max_pairs=4, fp8=True),
                                         tol[bf16]),
        "fp8_gpu_binding_bf16": (lambda: check_binding(bf16, fp8=True), tol[bf16]),
        # int4 experts (W4A16, the engc int4 layout, groups of 32): decode, grouped, with a shared expert,
        # prefill; a group as wide as the row (per-channel scales of a checkpoint whose group covers K)
        "int4_decode_bf16": (lambda: check_forward(bf16, 4, int4=32), tol[bf16]),
        "int4_grouped_bf16": (lambda: check_forward(bf16, 29, max_pairs=4, renormalize=1, int4=32), tol[bf16]),
        "int4_grouped_shared_fp32": (lambda: check_forward(f32, 21, shared=40, max_pairs=4, int4=32), tol[f32]),
        "int4_prefill_fp32": (lambda: check_forward(f32, 40, max_pairs=4, min_rows=8, int4=32), tol[f32]),
        "int4_whole_row_group_fp32": (lambda: check_forward(f32, 9, max_pairs=4, int4=64), tol[f32]),
        # the prefill variants (BLOCK_M 64): 80 pairs of 6 experts reach 8 an expert; 300 fill several blocks
        # of some experts; 80 pairs short of 16 an expert stay on the small-tile pair
        "prefill_fp32": (lambda: check_forward(f32, 40, max_pairs=4, min_rows=8), tol[f32]),
        "prefill_bf16": (lambda: check_forward(bf16, 40, max_pairs=4, min_rows=8, renormalize=1), tol[bf16]),
        "prefill_shared_fp32": (lambda: check_forward(f32, 33, shared=40, max_pairs=4, min_rows=8), tol[f32]),
        "prefill_many_blocks_fp32": (lambda: check_forward(f32, 150, max_pairs=4, min_rows=8), tol[f32]),
        "below_prefill_threshold_fp32": (lambda: check_forward(f32, 40, max_pairs=4, min_rows=16), tol[f32]),
        "fp8_prefill_fp32": (lambda: check_forward(f32, 40, max_pairs=4, min_rows=8, fp8=True), tol[f32]),
        # the sort kernel's schedule is sort_by_expert's to the row: one token; a grouped batch; most experts
        # without pairs (the tail blocks all padding); every pair on one expert; the prefill BLOCK_M; as many
        # experts as histogram bins (E = E_PAD: the masked lanes of a partial count chunk have no spare bin);
        # several programs, each ranking a span in several steps, counting in several masked chunks and
        # sharing out the padding; one program looping over all of it
        "sort_one_token": (lambda: check_sort(1, 2, 6, 16), 0),
        "sort_grouped": (lambda: check_sort(37, 2, 6, 16), 0),
        "sort_mostly_empty_experts": (lambda: check_sort(9, 4, 32, 4), 0),
        "sort_all_on_one_expert": (lambda: check_sort(50, 2, 10, 8, ids=torch.full((50, 2), 3)), 0),
        "sort_prefill_block": (lambda: check_sort(150, 2, 6, 64), 0),
        "sort_pow2_experts": (lambda: check_sort(61, 2, 8, 16, overrides={"SCAN_BLOCK": 32}), 0),
        "sort_many_programs": (lambda: check_sort(300, 3, 10, 8, overrides={"RANK_BLOCK": 16, "SCAN_BLOCK": 32,
                                                                           "max_programs": 5}), 0),
        "sort_one_program_loops": (lambda: check_sort(200, 4, 60, 32, overrides={"RANK_BLOCK": 16,
                                                                                "max_programs": 1}), 0),
    }
    wanted = sys.argv[1:]   # case names: only those (a file's checks take minutes under the interpreter)
    print_report({k: v for k, v in checks.items() if not wanted or k in wanted})


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    from test_fp8 import _patch_interpreter_fp8_cast
    _patch_interpreter_fp8_cast()   # fp8 experts quantize their inputs: the GPU's rounding, bit for bit
    main()
