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


@pytest.mark.parametrize("version, says", [([9, 0], "newer than this engc reads"),
                                           ([7, 0], "written by an older engc .* rebuild it")])
def test_other_formats_are_refused_with_what_to_do(copy_of, version, says):
    """One bundle format per major: a newer one asks for a newer engc, an older one (7.0: an MoE node whose
    inputs are its shared expert's weights, where this runtime reads the shared expert's output) for a
    rebuild; neither is half-read."""
    b = copy_of()
    m = json.loads((b / "manifest.json").read_text())
    m["format_version"] = version
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=f"format {version[0]}.0 (is|was) {says}"):
        open_bundle(b)


def test_the_program_has_its_decode_form(copy_of):
    """The compiler writes the decode form (passes/decode_form) and the executor runs only the nodes an
    output needs: the step form gathers the sampled rows and casts them to float32, the decode form runs
    the head over every row in the model dtype, and neither runs the other's head."""
    from engc.bundle.program import DECODE_OUTPUT, parse_program
    from engc.runtime.executor import Executor
    from engc.runtime.ops_reference import REFERENCE_OPS
    b = open_bundle(copy_of())
    program = parse_program(b.read(b.manifest["program"]))
    assert program.outputs == ("logits", DECODE_OUTPUT)
    ex = Executor(program, {n: None for n in program.initializers}, REFERENCE_OPS)
    step_ops = [impl for impl, *_ in ex.steps]
    decode_ops = [impl for impl, *_ in ex.decode_steps]
    assert REFERENCE_OPS[("", "Gather")] in step_ops and REFERENCE_OPS[("", "Cast")] in step_ops
    assert REFERENCE_OPS[("", "Cast")] not in decode_ops
    assert len(step_ops) == len(decode_ops) + 2   # the decode form drops exactly the row gather and the cast
    assert [outs for _, _, outs, *_ in ex.decode_steps][-1] == (DECODE_OUTPUT,)


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
