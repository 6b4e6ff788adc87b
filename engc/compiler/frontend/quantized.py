"""Pre-quantized int4 checkpoints (AutoAWQ GEMM, GPTQ v1/v2) as a Checkpoint in the engc int4 layout.

Each quantized projection `P` (P.qweight, P.qzeros, P.scales[, P.g_idx] in the file) is offered as
P.qweight, P.scales, P.zeros[, P.perm] laid out as kernels/int4_linear wants them; the decoder lowers
a projection that has P.qweight to QLinear, the lm_head too where the checkpoint quantized it
(GPTQModel's `lm_head: true`). Everything else passes through from the HF folder reader. A fused projection
(Phi-3's qkv_proj and gate_up_proj, InternLM2's wqkv, as AutoAWQ and GPTQModel quantize them whole) is repacked
whole too: frontend/layouts.py splits its N-major rows into the parts the lowering reads, `perm` shared.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.hf import read_hf_folder
from engc.compiler.quantize.formats import AWQ_ORDER, NATURAL, unpack_columns, unpack_rows
from engc.errors import UserError
from engc.kernels import int4_linear
from engc.kernels.int4_linear import check_shape, pack_int4
from engc.kernels.int4_linear.layout import dequantize

GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def is_quantized(hf_config: dict) -> bool:
    """An int4 checkpoint (AWQ, GPTQ) this reader takes; block-scaled float8 ones are fp8_checkpoint.py's."""
    qc = hf_config.get("quantization_config")
    return bool(qc) and qc.get("quant_method") != "fp8"


def read_quantized_folder(path: Path) -> Checkpoint:
    ckpt = read_hf_folder(path)
    qc = check_config(ckpt.hf_config.get("quantization_config") or {}, ckpt.name)
    method = qc["quant_method"]
    prefixes = sorted(n[:-len(".qweight")] for n in ckpt.names() if n.endswith(".qweight"))
    if not prefixes:
        raise UserError(f"{ckpt.name}: config.json says {method} but no tensor is named *.qweight")
    loaders = {n: f for n, f in ckpt.loaders.items()
               if not n.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for p in prefixes:
        src = {k: ckpt.loaders.get(f"{p}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
        if not all(src[k] for k in ("qweight", "qzeros", "scales")):
            raise UserError(f"{ckpt.name}: {p} has qweight but lacks qzeros or scales")
        src["scales"] = _checked_scales(src, qc, p, ckpt.name)
        loaders.update({f"{p}.{k}": f for k, f in _engc_loaders(src, qc).items()})
    ckpt.loaders = loaders
    return ckpt


def check_config(qc: dict, name: str) -> dict:
    method = qc.get("quant_method")
    if method not in ("awq", "gptq"):
        raise UserError(f"{name}: quantization '{method}' is not supported; engc reads awq and gptq int4")
    if qc.get("bits", 4) != 4:
        raise UserError(f"{name}: {qc.get('bits')}-bit {method} is not supported; engc reads 4-bit")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise UserError(f"{name}: AWQ version '{qc.get('version')}' is not supported; engc reads the GEMM layout")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in GPTQ_ZERO_OFFSET:
        raise UserError(f"{name}: GPTQ checkpoint_format '{qc.get('checkpoint_format')}' is not supported")
    return qc


def group_size(qc: dict, in_features: int) -> int:
    g = int(qc.get("group_size", 128))
    return in_features if g <= 0 else g


def describe(qc: dict, lm_head: bool = False) -> dict:
    """The manifest's `quantization` field. lm_head: the checkpoint has an int4 lm_head (lm_head.qweight)."""
    return {"method": (qc.get("meta") or {}).get("method", qc["quant_method"]), "bits": 4,
            "group_size": int(qc.get("group_size", 128)), "source_format": qc["quant_method"],
            "act_order": bool(qc.get("desc_act", False)), "layout": int4_linear.LAYOUT, "lm_head": lm_head}


def _checked_scales(src: dict, qc: dict, prefix: str, name: str):
    """The scales loader, refusing scales whose rows are not one per group of the config's group size
    (a wrong group_size in config.json would otherwise build a bundle that computes garbage)."""
    read_scales = src["scales"]
    def load():
        scales = read_scales()
        if qc["quant_method"] == "awq":
            in_features = src["qweight"]().shape[0]  # AWQ packs along out: qweight [in, out / 8]
        elif src["g_idx"] is not None:
            in_features = src["g_idx"]().shape[0]
        else:
            in_features = src["qweight"]().shape[0] * 8
        g = group_size(qc, in_features)
        if scales.shape[0] != -(-in_features // g):
            raise UserError(f"{name}: {prefix}.scales has {scales.shape[0]} rows but {in_features} inputs "
                            f"in groups of {g} (group_size in quantization_config) need {-(-in_features // g)}")
        return scales
    return load


def _engc_loaders(src: dict, qc: dict) -> dict:
    """Loaders of the engc int4 layout (N-major: kernels/int4_linear) from the checkpoint's tensors,
    each read and repacked when the build asks for it."""
    if qc["quant_method"] == "awq":
        codes = lambda: unpack_columns(src["qweight"](), AWQ_ORDER)  # noqa: E731  [K, N]
        return {"qweight": lambda: _pack(codes(), qc),
                "zeros": lambda: unpack_columns(src["qzeros"](), AWQ_ORDER).T.contiguous(),
                "scales": lambda: src["scales"]().T.contiguous()}
    offset = GPTQ_ZERO_OFFSET[qc.get("checkpoint_format", "gptq")]
    out = {"zeros": lambda: ((unpack_columns(src["qzeros"](), NATURAL).to(torch.int16) + offset) & 0xF)
           .to(torch.uint8).T.contiguous(),
           "scales": lambda: src["scales"]().T.contiguous(),
           "qweight": lambda: _pack(unpack_rows(src["qweight"]()), qc)}
    if qc.get("desc_act") and not qc.get("static_groups") and src["g_idx"] is not None:
        # groups of an act-order weight are scattered over the inputs: sort the input rows by group (static
        # groups, GPTQ's act-order with the groups left in channel order, need nothing)
        perm = lambda: torch.argsort(src["g_idx"]().long(), stable=True)  # noqa: E731
        out["qweight"] = lambda: _pack(unpack_rows(src["qweight"]())[perm()], qc)
        out["perm"] = perm
    return out


def _pack(codes, qc: dict):
    """codes uint8 [K, N] -> the engc layout's qweight [N, K // 8], refusing K the layout cannot hold."""
    k = codes.shape[0]
    why = check_shape(k, group_size(qc, k))
    if why:
        raise UserError(f"int4 projection with {k} inputs: {why}")
    return pack_int4(codes.T.contiguous())


def dequantized(get, has, prefix: str, qc: dict, in_features: int):
    """A loader of the float weight [N, K] of the int4 projection `prefix` (engc layout, as read_quantized_folder
    offers it; get(name) loads one of its tensors, has(name) says whether there is one), for a projection the
    build lays out as float: DeepSeek's kv_b_proj, split per head into the attention's w_uk / w_uv, and its
    shared experts, which the MoE node computes as dense GEMMs. An act-order weight's sorted input columns go
    back to channel order."""
    def load():
        scales = get(prefix + ".scales").float()
        w = dequantize(get(prefix + ".qweight"), scales, get(prefix + ".zeros"), group_size(qc, in_features))
        if has(prefix + ".perm"):   # sorted column j reads input perm[j]
            w = torch.empty_like(w).index_copy_(1, get(prefix + ".perm").long(), w)
        return w
    return load
