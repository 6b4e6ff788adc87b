"""The sampling kernels a model needs: one per logits dtype the sampler hands them (the head's, float32)."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2


def specs(b: Build) -> list:
    _, entry = tune.lookup(b.arch, "sampling", "*", "any", b.ov("sampling"))
    block_v = entry["BLOCK_V"]
    # candidate slots a row (no more than the vocabulary needs), the smaller set read where they suffice,
    # and the lane groups whose maxima bound the top-k threshold (whole lanes at most)
    cap = min(entry["cap"], pow2(b.cfg.vocab_size))
    consts = {"VOCAB": b.cfg.vocab_size, "CAP": cap, "SMALL": min(entry["small"], cap),
              "GROUPS": min(entry["groups"], block_v)}
    out = []
    for lt in sorted({b.t, "fp32"}):
        types = {"logits_ptr": f"*{lt}", "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
                 "uniform_ptr": "*fp32", "min_p_ptr": "*fp32", "out_ptr": "*i64", "cand_val_ptr": "*fp32",
                 "cand_idx_ptr": "*i32"}
        out.append(make_spec("sampling", f"logits_{lt}", b.arch, "sample_kernel", types, consts, "any",
                             launch_keys=("CAP",), overrides=b.ov("sampling")))
    return out
