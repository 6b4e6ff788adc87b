"""The bundle contract: deterministic builds, verification, refusal of damaged or foreign bundles."""
import json
import shutil

import pytest

from engc.bundle.reader import open_bundle
from engc.compiler.build import BuildOptions, build
from engc.errors import BundleError, UserError


def tree_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_rebuild_is_byte_identical(tiny_dir, tmp_path):
    src = str(tiny_dir("qwen2"))
    build(src, tmp_path / "a", BuildOptions())
    build(src, tmp_path / "b", BuildOptions())
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_manifest_hashes_every_file_and_program_has_no_weights(tiny_bundle):
    b = open_bundle(tiny_bundle("llama"))
    files = {p.relative_to(b.path).as_posix() for p in b.path.rglob("*") if p.is_file()}
    assert set(b.manifest["files"]) == files - {"manifest.json"}
    program = b.read("program.onnx")
    weights = b.file("weights/rank0.safetensors").stat().st_size
    assert len(program) < weights / 20  # structure only: initializers point into the safetensors


def test_program_external_data_points_at_the_weights(tiny_bundle):
    """program.onnx's initializers resolve, through standard ONNX external data, to the real tensors."""
    import onnx
    from onnx import numpy_helper
    from safetensors.torch import load_file
    root = tiny_bundle("llama")
    model = onnx.load(str(root / "program.onnx"), load_external_data=True)
    weights = load_file(str(root / "weights/rank0.safetensors"))
    for init in model.graph.initializer:
        assert (numpy_helper.to_array(init) == weights[init.name].numpy()).all(), init.name


@pytest.fixture
def copy_of(tiny_bundle, tmp_path):
    def make(family="llama"):
        dst = tmp_path / "copy"
        shutil.copytree(tiny_bundle(family), dst)
        return dst
    return make


def test_flipped_weight_byte_is_caught(copy_of):
    b = copy_of()
    w = b / "weights/rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0x01
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="does not match its sha256"):
        open_bundle(b)


def test_future_format_is_refused(copy_of):
    b = copy_of()
    m = json.loads((b / "manifest.json").read_text())
    m["format_version"] = [3, 0]
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="format 3.0 is newer"):
        open_bundle(b)


def test_format_version_marks_what_older_runtimes_would_misread():
    """1.0 unless the bundle holds int4 weights in the N-major layout or a quantized KV cache (2.0): a
    1.x runtime refuses a 2.0 bundle with one line instead of misreading it."""
    from engc.bundle.manifest import format_version
    assert format_version({"quantization": None, "kv_cache": "auto"}) == (1, 0)
    assert format_version({"quantization": {"method": "fp8"}}) == (1, 0)   # 1.x refuses FP8Linear by name
    assert format_version({"quantization": {"layout": "engc-int4-nmajor"}}) == (2, 0)
    assert format_version({"quantization": None, "kv_cache": "int8"}) == (2, 0)


@pytest.mark.parametrize("damage", ["delete", "extra", "garbage_manifest", "path_escape"])
def test_damaged_bundles_are_refused(copy_of, damage):
    b = copy_of()
    if damage == "delete":
        (b / "tokenizer/tokenizer.json").unlink()
    elif damage == "extra":
        (b / "weights/evil.py").write_text("import os")
    elif damage == "garbage_manifest":
        (b / "manifest.json").write_bytes(b"\x00{not json")
    else:
        m = json.loads((b / "manifest.json").read_text())
        m["files"]["../outside"] = "0" * 64
        (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError):
        open_bundle(b)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tmp_path / "src"
    shutil.copytree(tiny_dir("llama"), src)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(UserError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        build(str(src), tmp_path / "out", BuildOptions())
    assert not (tmp_path / "out").exists()  # no half-written bundle is left behind


def test_big_files_are_verified_by_chunks(tiny_dir, tmp_path, monkeypatch):
    """Loading checks big files by parallel chunk digests; a flipped byte in any chunk is caught."""
    from engc.bundle import hashing
    monkeypatch.setattr(hashing, "CHUNK", 4096)
    monkeypatch.setattr(hashing, "CHUNKED_ABOVE", 8192)
    out = tmp_path / "b"
    build(str(tiny_dir("llama")), out, BuildOptions())
    manifest = json.loads((out / "manifest.json").read_text())
    table = manifest["chunks"]["weights/rank0.safetensors"]
    assert table["size"] == 4096 and len(table["sha256"]) > 2
    open_bundle(out)
    w = out / "weights/rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[4096 * 2 + 17] ^= 0x04
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="does not match"):
        open_bundle(out)


def test_loader_checks_big_files_while_reading_them(tiny_dir, tmp_path, monkeypatch):
    from engc.bundle import hashing
    from engc.runtime.loader import load
    monkeypatch.setattr(hashing, "CHUNK", 4096)
    monkeypatch.setattr(hashing, "CHUNKED_ABOVE", 8192)
    out = tmp_path / "b"
    build(str(tiny_dir("llama")), out, BuildOptions())
    load(out)
    w = out / "weights/rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[-100] ^= 0x10  # inside a tensor: safetensors reads it happily, only the digest can tell
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="rank0.safetensors does not match"):
        load(out)
