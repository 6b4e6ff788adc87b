"""The int4_linear kernels of a program with int4 QLinears, for each group size they use: a GEMV per row
bucket (GEMV_ROWS), the dequant kernel (prefill-sized M: dequantize, then cuBLAS), and the GEMV's split-K
reduce (group-free)."""
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.errors import UserError
from engc.kernels.int4_linear import CHUNK, GEMV_ROWS, dequant_variant, gemv_variant


def specs(b: Build) -> list:
    return int4_linear_specs(b.t, b.arch, b.int4_group_sizes, b.ov("int4_linear"))


def int4_linear_specs(t: str, arch: str, group_sizes, overrides=None) -> list:
    """overrides: tune bucket ('gemv_m1', 'dequant', ...) -> entry."""
    if not group_sizes:
        return []
    ov = overrides or {}
    ptr = {"qw_ptr": "*i32", "s_ptr": f"*{t}", "z_ptr": "*u8"}
    gemv_types = dict(ptr, x_ptr=f"*{t}", bias_ptr=f"*{t}", y_ptr=f"*{t}", part_ptr="*fp32", M="i32", N="i32",
                      K="i32", chunks_per_split="i32", has_bias="i32")
    dequant_types = dict(ptr, w_ptr=f"*{t}", N="i32", K="i32")
    out = []
    for g in sorted(set(int(g) for g in group_sizes)):
        if g % CHUNK:  # a group covering all of K (per-channel) is fine too, but then g is K, a multiple of 32
            raise UserError(f"int4 group size {g} is not a multiple of {CHUNK}, which the engc int4 layout needs")
        for rows in GEMV_ROWS:
            bucket = f"gemv_m{rows}"
            out.append(make_spec("int4_linear", gemv_variant(rows, g), arch, "int4_gemv_kernel", gemv_types,
                                 {"GROUP": g, "BLOCK_M": rows}, bucket, overrides=ov.get(bucket),
                                 launch_keys=("BLOCK_N", "BLOCK_C", "gemv_max_rows", "target_programs",
                                              "max_splits")))
        out.append(make_spec("int4_linear", dequant_variant(g), arch, "int4_dequant_kernel", dequant_types,
                             {"GROUP": g}, "dequant", overrides=ov.get("dequant"),
                             launch_keys=("BLOCK_N", "BLOCK_C")))
    reduce_types = {"part_ptr": "*fp32", "bias_ptr": f"*{t}", "y_ptr": f"*{t}", "M": "i32", "N": "i32",
                    "num_splits": "i32", "has_bias": "i32"}
    out.append(make_spec("int4_linear", "gemv_reduce", arch, "int4_gemv_reduce_kernel", reduce_types, {},
                         "gemv_reduce", overrides=ov.get("gemv_reduce"), launch_keys=("BLOCK",)))
    return out
