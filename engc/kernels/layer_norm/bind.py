"""The nodes layer_norm serves: LayerNorm, AddLayerNorm and QKLayerNorm (the reference on every device)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.layer_norm import add_layer_norm, layer_norm, qk_layer_norm

CPU_OPS = {
    (ENGC_DOMAIN, "LayerNorm"): lambda x, w, eps: (layer_norm(x, w, eps),),
    (ENGC_DOMAIN, "AddLayerNorm"): lambda x, r, w, eps: add_layer_norm(x, r, w, eps),
    (ENGC_DOMAIN, "QKLayerNorm"): lambda qkv, qw, kw, **a: (qk_layer_norm(qkv, qw, kw, **a),),
}
