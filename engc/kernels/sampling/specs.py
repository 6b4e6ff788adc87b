"""The sampling kernels a model needs: one per logits dtype the sampler hands them (the head's, float32)."""
from engc.compiler.codegen.kernel_spec import Build, make_spec


def specs(b: Build) -> list:
    out = []
    for lt in sorted({b.t, "fp32"}):
        types = {"logits_ptr": f"*{lt}", "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
                 "uniform_ptr": "*fp32", "out_ptr": "*i64"}
        out.append(make_spec("sampling", f"logits_{lt}", b.arch, "sample_kernel", types,
                             {"VOCAB": b.cfg.vocab_size}, "any", overrides=b.ov("sampling")))
    return out
