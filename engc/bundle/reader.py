"""Opens a bundle and verifies it before anything is used: format version, manifest fields, hashes.

Only JSON and safetensors are read from a bundle; nothing in it is executed. Every refusal is a
BundleError with one line naming the problem.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engc.bundle.manifest import FORMAT, FORMAT_VERSION, MANIFEST, READABLE_MAJORS, REQUIRED
from engc.bundle.model_config import ModelConfig
from engc.bundle.hashing import chunk_digests, sha256_file
from engc.errors import BundleError


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.manifest["model"])

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    def file(self, rel: str) -> Path:
        return self.path / rel

    def read(self, rel: str) -> bytes:
        return (self.path / rel).read_bytes()


def open_bundle(path: Path | str, verify_hashes: bool = True, defer_big: bool = False) -> Bundle:
    """Refuses a bundle with any problem. defer_big leaves the big (chunk-hashed) files' digests to a
    later verify_big_files call, so a loader can check them while it reads the weights."""
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle folder")
    manifest = read_manifest(path)
    raise_problems(path, check_files(path, manifest, verify_hashes, skip=_big(manifest) if defer_big else ()))
    return Bundle(path=path, manifest=manifest)


def verify_big_files(bundle: Bundle, among=None) -> None:
    """among: only these of them (a tensor-parallel rank checks the weight file it reads)."""
    only = {rel: bundle.manifest["files"][rel] for rel in _big(bundle.manifest) if among is None or rel in among}
    raise_problems(bundle.path, check_files(bundle.path, dict(bundle.manifest, files=only), True, extra=False))


def raise_problems(path: Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BundleError(f"{path}: {problems[0]}{more}")


def _big(manifest: dict) -> set[str]:
    chunks = manifest.get("chunks")
    return set(chunks) & set(manifest["files"]) if isinstance(chunks, dict) else set()


def read_manifest(path: Path) -> dict:
    mf = path / MANIFEST
    if not mf.is_file():
        raise BundleError(f"{path}: not a bundle (no {MANIFEST})")
    try:
        manifest = json.loads(mf.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mf}: corrupted manifest ({e.__class__.__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{mf}: not an engc bundle manifest")
    version = manifest.get("format_version")
    if not (isinstance(version, list) and len(version) == 2 and all(isinstance(v, int) for v in version)):
        raise BundleError(f"{mf}: malformed format_version {version!r}")
    if version[0] not in READABLE_MAJORS:
        readable = " and ".join(f"{m}.x" for m in READABLE_MAJORS)
        if version[0] > FORMAT_VERSION[0]:
            raise BundleError(f"{path}: bundle format {version[0]}.{version[1]} is newer than this engc reads "
                              f"({readable}): upgrade engc, or rebuild the bundle with this one")
        raise BundleError(f"{path}: bundle format {version[0]}.{version[1]} was written by an older engc (this one "
                          f"reads {readable}): rebuild it with `engc build`")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise BundleError(f"{mf}: manifest lacks {', '.join(missing)}")
    return manifest


def check_files(path: Path, manifest: dict, verify_hashes: bool = True, whole_files: bool = False,
                skip=(), extra: bool = True) -> list[str]:
    """Every problem found, one line each: missing, extra, resized or altered files.

    Big files are checked by their chunk digests (in parallel) unless whole_files asks for both."""
    problems = []
    listed, chunks = manifest["files"], manifest.get("chunks", {})
    if not isinstance(listed, dict) or not isinstance(chunks, dict):
        return ["manifest 'files' or 'chunks' is not a table"]
    for rel, digest in sorted(listed.items()):
        p = path / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"manifest names a path outside the bundle: {rel}")
        elif not p.is_file():
            problems.append(f"missing file {rel}")
        elif verify_hashes and rel not in skip and not _intact(p, digest, chunks.get(rel), whole_files):
            problems.append(f"{rel} does not match its sha256 in the manifest (corrupted or tampered)")
    if not extra:
        return problems
    unlisted = [p.relative_to(path).as_posix() for p in sorted(path.rglob("*"))
                if p.is_file() and p.name != MANIFEST and p.relative_to(path).as_posix() not in listed]
    problems += [f"unexpected file {rel} (not in the manifest)" for rel in unlisted]
    for key in ("program", "weights"):
        for rel in ([manifest[key]] if isinstance(manifest[key], str) else manifest[key]):
            if rel not in listed:
                problems.append(f"manifest {key} '{rel}' is not among its files")
    return problems


def _intact(p: Path, digest: str, chunked: dict | None, whole_file: bool) -> bool:
    if chunked is None or whole_file:
        if sha256_file(p) != digest:
            return False
    if chunked is not None:
        size = chunked.get("size")
        return isinstance(size, int) and size > 0 and chunk_digests(p, size) == chunked.get("sha256")
    return True


def size_problems(bundle: Bundle) -> list[str]:
    """Files whose length says they were cut short or grew, found without hashing: a safetensors file's
    length is fixed by its header, and a chunk-hashed file's lies within its last chunk."""
    problems = []
    for rel in sorted(bundle.manifest["files"]):
        p = bundle.path / rel
        if not p.is_file():
            continue
        size, expected = p.stat().st_size, None
        if rel.endswith(".safetensors"):
            expected = _safetensors_length(p)
        chunked = bundle.manifest.get("chunks", {}).get(rel)
        if expected is None and isinstance(chunked, dict) and isinstance(chunked.get("sha256"), list):
            n, step = len(chunked["sha256"]), chunked.get("size", 0)
            if not (n - 1) * step < size <= n * step:
                problems.append(f"{rel} is {size:,} bytes, not the {(n - 1) * step:,}-{n * step:,} it was written with")
        elif expected is not None and size != expected:
            problems.append(f"{rel} is {size:,} bytes where its header says {expected:,} (cut short or altered)")
    return problems


def _safetensors_length(p: Path) -> int | None:
    """8 + header + the end of the last tensor's data; None where the header cannot be read."""
    try:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < 1 << 30 else None
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    return 8 + n + max(ends, default=0)
