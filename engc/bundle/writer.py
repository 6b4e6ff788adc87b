"""Writes a bundle deterministically: sorted keys, no timestamps, sha256 of every file in the manifest.

The folder is assembled beside the target and renamed into place (engc/atomic.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from engc.atomic import atomic_folder
from engc.bundle.hashing import chunk_table, sha256_file
from engc.bundle.manifest import FORMAT, FORMAT_VERSION, MANIFEST


def write_bundle(out: Path, manifest: dict, files: dict[str, bytes], write_large) -> dict:
    """files: small bundle-relative files; write_large(tmp_dir) writes the big ones (weights) itself."""
    with atomic_folder(out) as tmp:
        write_large(tmp)
        for rel, data in sorted(files.items()):
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        files = hash_tree(tmp)
        chunks = {rel: table for rel in files if (table := chunk_table(tmp / rel)) is not None}
        manifest = dict(manifest, format=FORMAT, format_version=list(FORMAT_VERSION), files=files,
                        chunks=chunks)
        (tmp / MANIFEST).write_bytes(dump_manifest(manifest))
    return manifest


def dump_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def hash_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
