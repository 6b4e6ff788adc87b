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
# holds the scaled copy, the block's outputs per scale candidate and the clip search's full-width chunks.
# Measured per layer (VmHWM reset each layer): AWQ's live working set is ~+170 MB (3.5 layers; with
# MALLOC_MMAP_THRESHOLD_=4 MiB, where RSS = live bytes), and glibc's heap fragmentation adds 0-100 MB on
# top, differently each layer: +200 to +270 MB (4-5.5 layers), no trend with depth. RTN +111 MB = 2.3.
# The growth does not depend on depth (that is the point), so the model is made deep enough to be about
# twice the largest bound.
LAYERS_OF_PEAK = {"rtn": 4, "awq": 8}


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deep") / "m"
    return folder, write_random_llama(folder, **SHAPE)


# GPTQ's column loop takes over 10 minutes on this model on a shared 2-core CPU: its peak (the layer
# plus K x K Hessian matrices) is measured by bench/quant_memory.py instead. AWQ searches a grid of 4
# points, not 20: the candidates are scored one after another, so the grid's length sets the time, not
# the peak, and 4 keeps the run to a minute or two on a loaded 2-core machine.
@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_peak_memory_is_about_one_layer(method, deep_model, tmp_path):
    src, sizes = deep_model
    # the child also counts live tensors after each layer (release_freed_memory runs once a layer):
    # a tensor kept per layer (activations, hooks, autograd graphs, stats) shows there whatever its size
    code = ("import gc, json, sys, torch; from pathlib import Path; from engc.compiler.quantize import QuantOptions; "
            "from engc.compiler.quantize import stream; counts = []; release = stream.release_freed_memory; "
            "stream.release_freed_memory = lambda: (release(), gc.collect(), counts.append(sum("
            "isinstance(o, torch.Tensor) for o in gc.get_objects()))); "
            "s = stream.quantize_checkpoint(sys.argv[1], Path(sys.argv[2]), QuantOptions("
            "method=sys.argv[3], group_size=128, calib_samples=2, calib_seqlen=32, awq_grid=4)); "
            "print(json.dumps(dict(s, tensors_after_layer=counts[:s['layers']])))")
    # VmHWM (what the summary reports) belongs to the child alone; ru_maxrss would carry pytest's peak.
    # The timeout only turns a hung child into a failure: it is 20x the run's time on a loaded machine
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "q"), method],
                          capture_output=True, text=True, timeout=3600, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    layer_mb, model_mb = s["layer_weights_mb"], 2 * sizes["model_bytes"] / 2**20  # float32, as quantized
    assert layer_mb == pytest.approx(2 * sizes["layer_bytes"] / 2**20, rel=0.01)
    bound = LAYERS_OF_PEAK[method] * layer_mb
    assert model_mb > 1.9 * bound  # holding the model (or half of it) would break the bound
    growth = s["peak_rss_mb"] - s["start_rss_mb"]
    print(f"{method}: model {model_mb:.0f} MB fp32, layer {layer_mb:.0f} MB, peak growth {growth:.0f} MB")
    assert growth < bound, s
    # nothing accumulates from layer to layer: the same live tensors, and the heap back to the same level
    # (the summary's anonymous RSS; the checkpoint's mapped pages are the kernel's cache, not ours). The
    # heap's fragmentation moves it a megabyte or two either way from layer to layer, with no trend; a
    # tenth of a layer over 15 layers catches a leak of a third of a megabyte a layer
    assert len(set(s["tensors_after_layer"][1:])) == 1, s["tensors_after_layer"]
    rss = s["layer_end_rss_mb"]
    assert max(rss[1:]) - min(rss[1:]) < 0.1 * layer_mb, rss
    # a shard a layer, and the embedding with the final norm in one (under REST_SHARD_BYTES together)
    assert len(list((tmp_path / "q").glob("model-*.safetensors"))) == SHAPE["layers"] + 1


@pytest.mark.parametrize("limit, rest_shards", [(1 << 20, 1), (1000, 2)])
def test_tensors_outside_the_layers_share_shards_up_to_the_limit(limit, rest_shards, tiny_dir, tmp_path, monkeypatch):
    """The embedding and the final norm: one shard under the limit, each its own over it (a tensor past the limit
    alone); every shard named -of-<n> for the n written, and the index naming the file that holds each tensor."""
    import json
    from safetensors import safe_open
    from engc.compiler.quantize import QuantOptions, stream
    monkeypatch.setattr(stream, "REST_SHARD_BYTES", limit)
    stream.quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    files = sorted(p.name for p in (tmp_path / "q").glob("model-*.safetensors"))
    assert len(files) == 2 + rest_shards and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(files)
    for name, file in index.items():
        with safe_open(str(tmp_path / "q" / file), framework="pt") as f:
            assert name in f.keys()
