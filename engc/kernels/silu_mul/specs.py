"""The gated-activation kernels a model needs: SiLU's always (SiluMul, and the unfused paths of QLinearSiluMul and
SiluMulLinear), and the model's own activation's where it is another (Gemma's GELU-tanh); each specialized on
the intermediate size."""
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.kernels.silu_mul import ACTIVATIONS, VARIANT_OF_ACT


def specs(b: Build) -> list:
    types = {"gate_up_ptr": f"*{b.t}", "out_ptr": f"*{b.t}"}
    variants = sorted({"default", VARIANT_OF_ACT.get(b.cfg.hidden_act, "default")})
    return [make_spec("silu_mul", v, b.arch, "silu_mul_kernel", types,
                      {"INTER": b.cfg.intermediate_size, "ACT": ACTIVATIONS[v]}, "any", launch_keys=("BLOCK",),
                      overrides=b.ov("silu_mul"))
            for v in variants]
