"""The node the MoE kernels serve: MoE (router, top-k experts' SiLU GLUs, weighted combine)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.moe import moe

CPU_OPS = {(ENGC_DOMAIN, "MoE"): lambda *xs, **a: (moe(*xs, **a),)}
