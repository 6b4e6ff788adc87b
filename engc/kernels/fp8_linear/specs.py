"""The W8A8 GEMMs of an fp8 program's decode/small-prefill rows: per projection input width K (hidden: qkv,
gate_up; q_size: o; intermediate: down) and M class, taking float8 x from fp8_quant; plus a variant that
quantizes x itself where the class's entry says fuse_quant."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.errors import UserError
from engc.kernels.fp8_linear import variant_name
from engc.kernels.fp8_quant import FP8_ARCHS, FP8_MAX, MIN_AMAX, projection_input_widths

# the row classes it builds, each a bucket of the tune table (the table's m<=128 and m<=256 are for sweeps)
M_CLASSES = ("m<=16", "m<=32", "m<=64")


def specs(b: Build) -> list:
    return fp8_linear_specs(b.cfg, b.t, b.arch, b.ov("fp8_linear")) if b.quant == "fp8" else []


def fp8_linear_specs(cfg, t: str, arch: str, overrides=None, classes=None) -> list:
    """overrides: M class -> tune overrides; classes: the M classes to build (default: all)."""
    if arch not in FP8_ARCHS:
        raise UserError(f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {arch} has none")
    out = []
    for k in projection_input_widths(cfg):
        for bucket in classes or M_CLASSES:
            ov = (overrides or {}).get(bucket)
            _, entry = tune.lookup(arch, "fp8_linear", "*", bucket, ov)
            for quant_x in (False, True) if entry.get("fuse_quant") else (False,):
                types = {"x_ptr": f"*{t}" if quant_x else "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                         "w_scale_ptr": "*fp32", "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "partial_ptr": "*fp32",
                         "counter_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles_per_split": "i32",
                         "splits": "i32", "has_bias": "i32"}
                consts = {"K": k, "QUANT_X": quant_x, "FP8_MAX": FP8_MAX, "MIN_AMAX": MIN_AMAX}
                out.append(make_spec("fp8_linear", variant_name(k, entry["max_m"], quant_x), arch,
                                     "fp8_linear_kernel", types, consts, bucket, overrides=ov,
                                     launch_keys=("K", "QUANT_X", "max_m", "BLOCK_N", "BLOCK_K", "target_programs",
                                                  "max_splits", "min_split_k_tiles")))
    return out
