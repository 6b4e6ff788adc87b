"""The silu_mul kernel a model needs: one, specialized on the intermediate size."""
from engc.compiler.codegen.kernel_spec import Build, make_spec


def specs(b: Build) -> list:
    types = {"gate_up_ptr": f"*{b.t}", "out_ptr": f"*{b.t}"}
    return [make_spec("silu_mul", "default", b.arch, "silu_mul_kernel", types,
                      {"INTER": b.cfg.intermediate_size}, "any", launch_keys=("BLOCK",), overrides=b.ov("silu_mul"))]
