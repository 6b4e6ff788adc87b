"""Graph passes, one per file, run in this order by compiler/build.py (the option-driven ones it adds go
in before add_decode_form, which copies the finished head)."""
from engc.compiler.passes.decode_form import add_decode_form
from engc.compiler.passes.fuse_parallel_gemms import fuse_parallel_gemms
from engc.compiler.passes.fuse_qlinear_add_norm import fuse_qlinear_add_norm
from engc.compiler.passes.fuse_qlinear_silu_mul import fuse_qlinear_silu_mul
from engc.compiler.passes.fuse_rotary_attention import fuse_rotary_attention
from engc.compiler.passes.fuse_silu_mul_linear import fuse_silu_mul_linear

PASSES = [fuse_parallel_gemms, fuse_silu_mul_linear, fuse_qlinear_silu_mul, fuse_qlinear_add_norm,
          fuse_rotary_attention, add_decode_form]
