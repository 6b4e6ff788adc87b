"""Layer streaming: the quantizer's peak memory is bounded by one layer's size, whatever the depth.

The model is random and many layers deep, written one shard per layer (so making it is bounded too),
and quantized in a child process. The bound is a multiple of one layer's float32 weights, not of the
model: the model is several times bigger than the bound, so holding it (or a few layers of it) fails.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import write_random_llama

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden=1024, intermediate=2816, layers=16, heads=8, kv_heads=8, head_dim=128, vocab=1024)
# Peak growth allowed, in float32 layers: RTN holds the layer and its quantized/dequantized copies; AWQ also
# holds the scaled copy, the block's outputs per scale candidate and the clip search's full-width chunks
# (measured +272 to +304 MB = 5.5-6.2 layers, varying run to run with the allocator; RTN +111 MB = 2.3).
# The growth does not depend on depth (that is the point), so the model is made deep enough to be about
# twice the largest bound.
LAYERS_OF_PEAK = {"rtn": 4, "awq": 8}


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deep") / "m"
    return folder, write_random_llama(folder, **SHAPE)


# GPTQ's column loop takes over 10 minutes on this model on a shared 2-core CPU: its peak (the layer
# plus K x K Hessian matrices) is measured by bench/quant_memory.py instead
@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_peak_memory_is_about_one_layer(method, deep_model, tmp_path):
    src, sizes = deep_model
    code = ("import json, sys; from pathlib import Path; from engc.compiler.quantize import QuantOptions; "
            "from engc.compiler.quantize.stream import quantize_checkpoint; "
            "print(json.dumps(quantize_checkpoint(sys.argv[1], Path(sys.argv[2]), QuantOptions("
            "method=sys.argv[3], group_size=128, calib_samples=2, calib_seqlen=32))))")
    # VmHWM (what the summary reports) belongs to the child alone; ru_maxrss would carry pytest's peak
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "q"), method],
                          capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    layer_mb, model_mb = s["layer_weights_mb"], 2 * sizes["model_bytes"] / 2**20  # float32, as quantized
    assert layer_mb == pytest.approx(2 * sizes["layer_bytes"] / 2**20, rel=0.01)
    bound = LAYERS_OF_PEAK[method] * layer_mb
    assert model_mb > 1.9 * bound  # holding the model (or half of it) would break the bound
    growth = s["peak_rss_mb"] - s["start_rss_mb"]
    print(f"{method}: model {model_mb:.0f} MB fp32, layer {layer_mb:.0f} MB, peak growth {growth:.0f} MB")
    assert growth < bound, s
    assert len(list((tmp_path / "q").glob("model-*.safetensors"))) == SHAPE["layers"] + 2
