"""A human-readable summary of a bundle's manifest (engc inspect)."""
from __future__ import annotations

from engc.bundle.model_config import ModelConfig
from engc.bundle.reader import Bundle
from engc.bundle.tp import rank_config, vocab_rows


def describe(b: Bundle) -> str:
    m, c = b.manifest, b.manifest["model"]
    sizes = {rel: b.file(rel).stat().st_size for rel in m["files"] if b.file(rel).is_file()}
    lines = [
        f"bundle     {b.path}  (format {'.'.join(map(str, m['format_version']))})",
        f"model      {m['source']['name']}  family {c['family']}, {c['num_layers']} layers, "
        f"hidden {c['hidden_size']}, heads {c['num_heads']}/{c['num_kv_heads']}, vocab {c['vocab_size']}",
        f"dtype      {m['dtype']}   quantization {_short(m['quantization']) or 'none'}   tp {m['tp']}",
        *_gguf_kept(m['quantization']),
        *_tp_layout(b),
        f"archs      {', '.join(m['archs'])}   kv block {m['kv_block_size']} tokens   "
        f"kv cache {m.get('kv_cache', 'auto')}",
        _kv_bytes(m),
        f"kernels    {len(m['kernels'])}",
    ]
    for k in m["kernels"]:
        lines.append(f"  {k.get('arch', '?'):5} {k.get('op', '?'):16} {k.get('variant', ''):10} {k.get('entry', '')}")
    lines.append(f"files      {len(sizes)}, {sum(sizes.values()) / 1e6:.1f} MB")
    for rel, digest in sorted(m["files"].items()):
        lines.append(f"  {sizes.get(rel, 0):>12,}  {digest[:16]}  {rel}")
    return "\n".join(lines)


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _kv_bytes(m: dict) -> str:
    """The KV cache's bytes a token (all layers), and for latent attention the bytes per-head keys and values
    (nope + rope and v wide, as MHA would cache them) would take in the same format."""
    cfg = rank_config(ModelConfig.from_dict(m["model"]), m.get("tp", 1))   # each rank caches its own heads
    quantized = m.get("kv_cache", "auto") != "auto"   # 1-byte codes plus a float32 scale a row
    elt = 1 if quantized else _ELEMENT_BYTES.get(m["dtype"], 2)
    planes, rows, width = cfg.kv_cache_row
    per_token = cfg.num_layers * planes * rows * (width * elt + 4 * quantized)
    if not cfg.kv_lora_rank:
        return (f"kv bytes   {per_token:,} a token ({planes} x {rows} KV heads x {width} a layer)"
                + (" on each rank" if m.get("tp", 1) > 1 else ""))
    mha = cfg.num_layers * cfg.num_heads * ((cfg.head_dim + cfg.v_head_dim) * elt + 8 * quantized)
    return (f"kv bytes   {per_token:,} a token (latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim} a layer); "
            f"MHA-equivalent {mha:,} ({mha / per_token:.1f}x)")


def _tp_layout(b: Bundle) -> list[str]:
    """A tensor-parallel bundle: what each rank holds (bundle/tp.py, compiler/passes/shard_tp.py)."""
    m = b.manifest
    tp = m["tp"]
    if tp == 1:
        return []
    cfg = b.config
    rank = rank_config(cfg, tp)
    kv = "replicated" if cfg.num_kv_heads < tp else "split"
    moe = (f", experts {cfg.num_experts} each {rank.moe_intermediate_size} wide"
           + (f", shared {rank.shared_expert_intermediate_size}" if cfg.shared_expert_intermediate_size else "")
           if cfg.num_experts else "")
    return [f"tp layout  {tp} ranks, {m['weights'][0]} .. {m['weights'][-1]}; each rank: heads {rank.num_heads}/"
            f"{rank.num_kv_heads} (KV {kv}), intermediate {rank.intermediate_size}{moe}, lm_head "
            f"{vocab_rows(cfg, tp)} of {cfg.vocab_size} rows, embedding whole"]


def _short(quantization: dict | None) -> dict | None:
    return quantization and {k: v for k, v in quantization.items() if k not in ("kept", "dequantized")}


def _gguf_kept(quantization: dict | None) -> list[str]:
    """A GGUF built with --quant keep: which types stayed 4-bit, which tensors were dequantized to float."""
    if not quantization or "kept" not in quantization:
        return []
    kept = ", ".join(f"{t} x{n}" for t, n in sorted(quantization["kept"].items()))
    lines = [f"kept       {kept} (4-bit, groups of {quantization['group_size']})"]
    by_type: dict[str, list[str]] = {}
    for name, gguf_type in quantization["dequantized"].items():
        by_type.setdefault(gguf_type, []).append(name)
    for gguf_type, names in sorted(by_type.items()):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"dequantized {gguf_type} to the bundle dtype: {shown}")
    return lines
