"""The node logit_softcap serves: LogitSoftcap (CPU only; GPU builds needing it are refused)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.logit_softcap import logit_softcap

CPU_OPS = {(ENGC_DOMAIN, "LogitSoftcap"): lambda x, cap: (logit_softcap(x, cap),)}
