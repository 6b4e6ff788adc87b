"""The node logit_softcap serves: LogitSoftcap (the reference on every device)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.logit_softcap import logit_softcap

CPU_OPS = {(ENGC_DOMAIN, "LogitSoftcap"): lambda x, cap: (logit_softcap(x, cap),)}
