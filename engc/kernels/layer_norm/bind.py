"""The nodes layer_norm serves: LayerNorm and AddLayerNorm (the reference on every device)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.layer_norm import add_layer_norm, layer_norm

CPU_OPS = {
    (ENGC_DOMAIN, "LayerNorm"): lambda x, w, eps: (layer_norm(x, w, eps),),
    (ENGC_DOMAIN, "AddLayerNorm"): lambda x, r, w, eps: add_layer_norm(x, r, w, eps),
}
