"""A human-readable summary of a bundle's manifest (engc inspect)."""
from __future__ import annotations

from engc.bundle.reader import Bundle


def describe(b: Bundle) -> str:
    m, c = b.manifest, b.manifest["model"]
    sizes = {rel: b.file(rel).stat().st_size for rel in m["files"] if b.file(rel).is_file()}
    lines = [
        f"bundle     {b.path}  (format {'.'.join(map(str, m['format_version']))})",
        f"model      {m['source']['name']}  family {c['family']}, {c['num_layers']} layers, "
        f"hidden {c['hidden_size']}, heads {c['num_heads']}/{c['num_kv_heads']}, vocab {c['vocab_size']}",
        f"dtype      {m['dtype']}   quantization {m['quantization'] or 'none'}   tp {m['tp']}",
        f"archs      {', '.join(m['archs'])}   kv block {m['kv_block_size']} tokens   "
        f"kv cache {m.get('kv_cache', 'auto')}",
        f"kernels    {len(m['kernels'])}",
    ]
    for k in m["kernels"]:
        lines.append(f"  {k.get('arch', '?'):5} {k.get('op', '?'):16} {k.get('variant', ''):10} {k.get('entry', '')}")
    lines.append(f"files      {len(sizes)}, {sum(sizes.values()) / 1e6:.1f} MB")
    for rel, digest in sorted(m["files"].items()):
        lines.append(f"  {sizes.get(rel, 0):>12,}  {digest[:16]}  {rel}")
    return "\n".join(lines)
