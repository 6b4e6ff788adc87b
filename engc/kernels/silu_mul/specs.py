"""The gated-activation kernels a model needs: SiLU's always (SiluMul, and the unfused paths of QLinearSiluMul and
SiluMulLinear), and the model's own activation's where it is another (Gemma's GELU-tanh); each specialized on
the intermediate size: the model's, and a shared expert's where it differs (a variant of its own, VARIANT_WIDTH)."""
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.kernels.silu_mul import ACTIVATIONS, VARIANT_OF_ACT, VARIANT_WIDTH


def specs(b: Build) -> list:
    types = {"gate_up_ptr": f"*{b.t}", "out_ptr": f"*{b.t}"}
    variants = sorted({"default", VARIANT_OF_ACT.get(b.cfg.hidden_act, "default")})
    return [make_spec("silu_mul", v if i == b.cfg.intermediate_size else VARIANT_WIDTH.format(v, i), b.arch,
                      "silu_mul_kernel", types, {"INTER": i, "ACT": ACTIVATIONS[v]}, "any", launch_keys=("BLOCK",),
                      overrides=b.ov("silu_mul"))
            for v in variants for i in b.cfg.mlp_sizes]
