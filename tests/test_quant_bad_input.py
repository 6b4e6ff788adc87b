"""Bad input to `engc quantize` and to `engc build` of int4 checkpoints: one line `engc: error: ...`, exit 1.

The option checks of `engc quantize` (method, bits, group size, calibration file, act-order) are in
test_quant_e2e.py; these are the remaining cases: calibration sizes and JSONL, shapes int4 packing
cannot take, sources already quantized by another tool, and pre-quantized checkpoints `engc build`
cannot read.
"""
import json
import shutil

import pytest
from click.testing import CliRunner

from engc.cli import main
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.stream import quantize_checkpoint


def one_line_error(out, message):
    assert out.exit_code == 1, out.output
    assert out.output.count("\n") == 1 and out.output.startswith("engc: error:"), out.output
    assert message in out.output, out.output


def quantize(src, tmp_path, *args):
    return CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "o"), "--group-size", "32", *args])


@pytest.mark.parametrize("args,message", [
    (["--calib-samples", "0"], "--calib-samples must be >= 1"),
    (["--calib-seqlen", "4"], "--calib-seqlen >= 8"),
    (["--method", "gptq", "--damp", "1.5"], "--damp 1.5 must be in (0, 1)"),
    (["--bits", "8"], "--bits 8 is not supported"),
], ids=["samples", "seqlen", "damp", "bits8"])
def test_bad_options(args, message, tiny_dir, tmp_path):
    one_line_error(quantize(tiny_dir("llama"), tmp_path, *args), message)


def test_calibration_jsonl_with_a_broken_line(tiny_dir, tmp_path):
    calib = tmp_path / "c.jsonl"
    calib.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    one_line_error(quantize(tiny_dir("llama"), tmp_path, "--calib", str(calib)), "line 2 is not JSON")


def test_width_int4_packing_cannot_take(tiny_dir, tmp_path):
    # 60 inputs do not fill whole int32 words of 8 nibbles
    src = tiny_dir("llama", hidden_size=60, head_dim=16)
    one_line_error(quantize(src, tmp_path, "--method", "rtn"), "hidden_size 60 is not a multiple of 8")


@pytest.fixture
def rtn_checkpoint(tiny_dir, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(str(tiny_dir("llama")), out, QuantOptions(method="rtn", group_size=32))
    return out


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"quant_method": "bitsandbytes"}, "already quantized (bitsandbytes)"),
    ({"bits": 8}, "already quantized (gptq)"),
], ids=["other-method", "other-bits"])
def test_quantize_refuses_any_quantized_source(changes, message, rtn_checkpoint, tmp_path):
    edit_config(rtn_checkpoint, **changes)
    one_line_error(quantize(rtn_checkpoint, tmp_path, "--method", "rtn"), message)


@pytest.mark.parametrize("changes,message", [
    ({"quant_method": "bitsandbytes"}, "quantization 'bitsandbytes' is not supported"),
    ({"bits": 8}, "8-bit gptq is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
], ids=["method", "bits", "format"])
def test_build_refuses_quantized_checkpoints_it_cannot_read(changes, message, rtn_checkpoint, tmp_path):
    edit_config(rtn_checkpoint, **changes)
    one_line_error(CliRunner().invoke(main, ["build", str(rtn_checkpoint), "-o", str(tmp_path / "b"), "--json"]), message)


def test_build_refuses_a_quantized_config_without_int4_tensors(tiny_dir, tmp_path):
    src = tmp_path / "fake"
    shutil.copytree(tiny_dir("llama"), src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    (src / "config.json").write_text(json.dumps(config))
    out = CliRunner().invoke(main, ["build", str(src), "-o", str(tmp_path / "b"), "--json"])
    one_line_error(out, "no tensor is named *.qweight")


def test_build_refuses_scales_that_do_not_match_the_group_size(rtn_checkpoint, tmp_path):
    edit_config(rtn_checkpoint, group_size=16)  # the tensors hold groups of 32
    out = CliRunner().invoke(main, ["build", str(rtn_checkpoint), "-o", str(tmp_path / "b"), "--json"])
    one_line_error(out, "group")


def test_int4_bundle_of_another_layout_is_refused(tmp_path):
    """A bundle whose int4 weights were packed another way (an older engc) is refused, never misread."""
    import json
    import shutil
    from engc.compiler.build import BuildOptions, build
    from engc.errors import BundleError
    from engc.runtime.loader import load
    from tiny_models import make_tiny
    src = make_tiny("llama", tmp_path / "src")
    quantize_checkpoint(str(src), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    bundle = tmp_path / "b"
    build(str(tmp_path / "q"), bundle, BuildOptions())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["quantization"]["layout"] == "engc-int4-nmajor"
    load(bundle)  # this engc's own layout loads
    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    manifest["quantization"]["layout"] = "engc-int4"
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="packed as 'engc-int4'.*rebuild"):
        load(old, verify_hashes=False)
