"""Graph passes, one per file, run in this order by compiler/build.py, which adds the option-driven ones and,
last, decode_form.add_decode_form: the program's second output is part of the bundle format, not an
optimization a build may leave out."""
from engc.compiler.passes.fuse_parallel_gemms import fuse_parallel_gemms
from engc.compiler.passes.fuse_projection_qk_norm import fuse_projection_qk_norm
from engc.compiler.passes.fuse_qlinear_add_norm import fuse_qlinear_add_norm
from engc.compiler.passes.fuse_qlinear_silu_mul import fuse_qlinear_silu_mul
from engc.compiler.passes.fuse_rotary_attention import fuse_rotary_attention
from engc.compiler.passes.fuse_silu_mul_linear import fuse_silu_mul_linear

PASSES = [fuse_projection_qk_norm, fuse_parallel_gemms, fuse_silu_mul_linear, fuse_qlinear_silu_mul,
          fuse_qlinear_add_norm, fuse_rotary_attention]
