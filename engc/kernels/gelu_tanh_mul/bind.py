"""The node gelu_tanh_mul serves: GeluTanhMul (CPU only; GPU builds needing it are refused)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.gelu_tanh_mul import gelu_tanh_mul

CPU_OPS = {(ENGC_DOMAIN, "GeluTanhMul"): lambda x: (gelu_tanh_mul(x),)}
