"""The nodes unit_offset_norm serves: RMSNormUnitOffset, AddRMSNormUnitOffset, QKNormUnitOffset (CPU only;
GPU builds needing them are refused)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.unit_offset_norm import add_rms_norm_unit_offset, qk_norm_unit_offset, rms_norm_unit_offset

CPU_OPS = {
    (ENGC_DOMAIN, "RMSNormUnitOffset"): lambda x, w, eps: (rms_norm_unit_offset(x, w, eps),),
    (ENGC_DOMAIN, "AddRMSNormUnitOffset"): lambda x, r, w, eps: add_rms_norm_unit_offset(x, r, w, eps),
    (ENGC_DOMAIN, "QKNormUnitOffset"): lambda qkv, qw, kw, **a: (qk_norm_unit_offset(qkv, qw, kw, **a),),
}
