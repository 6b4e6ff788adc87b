"""Graph passes, one per file, run in this order by compiler/build.py."""
from engc.compiler.passes.fuse_parallel_gemms import fuse_parallel_gemms

PASSES = [fuse_parallel_gemms]
