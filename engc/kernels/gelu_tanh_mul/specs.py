"""The gelu_tanh_mul kernel a model needs: one, specialized on the intermediate size, for a model whose GLU is
GELU-tanh (Gemma); none for the others."""
from engc.compiler.codegen.kernel_spec import Build, make_spec


def specs(b: Build) -> list:
    if b.cfg.hidden_act != "gelu_pytorch_tanh":
        return []
    types = {"gate_up_ptr": f"*{b.t}", "out_ptr": f"*{b.t}"}
    return [make_spec("gelu_tanh_mul", "default", b.arch, "gelu_tanh_mul_kernel", types,
                      {"INTER": b.cfg.intermediate_size}, "any", launch_keys=("BLOCK",),
                      overrides=b.ov("gelu_tanh_mul"),
                      defaults={"BLOCK": 1024, "num_warps": 4, "num_stages": 1})]
