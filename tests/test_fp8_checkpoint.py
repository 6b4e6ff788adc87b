"""Block-scaled float8 checkpoints (DeepSeek-V3's and Qwen3-FP8's format: quant_method "fp8", weight_block_size,
P.weight_scale_inv): read dequantized, built float8 by default where the targets run it, refused in one line
when malformed. Made in the tests from tiny float checkpoints, with blocks that do not divide every width."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engc.compiler.build import BuildOptions, build, read_source
from engc.compiler.passes.quantize_fp8 import fp8_target_problem
from test_cli import assert_one_line_error, engc

BLOCK = [16, 24]   # 64-wide inputs: two whole column blocks and a 16-wide one; DeepSeek-V3's q_a has 24 rows


def _quantized(name: str, t: torch.Tensor) -> bool:
    """The projections DeepSeek and Qwen ship in float8: every layer matrix but norms and the router."""
    return name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2 \
        and not name.endswith("mlp.gate.weight")


def block_scales(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes and float32 scales a block: the block's absmax over 448 (e4m3's largest)."""
    (n, k), (bn, bk) = w.shape, block
    codes, scales = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def dequantized(codes: torch.Tensor, scales: torch.Tensor, block=BLOCK) -> torch.Tensor:
    out = torch.empty(codes.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = codes[rows, cols].float() * scales[i, j]
    return out


def fp8_pair(src, root):
    """src as a block-scaled float8 checkpoint, and the float checkpoint of its dequantized weights."""
    fp8, ref = root / "fp8", root / "dequantized"
    for d in (fp8, ref):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors, q, f = {}, {}, {}
    for shard in src.glob("*.safetensors"):
        tensors.update(load_file(shard))
    for name, t in tensors.items():
        if _quantized(name, t):
            codes, scales = block_scales(t)
            q[name], q[name + "_scale_inv"] = codes, scales
            f[name] = dequantized(codes, scales).to(t.dtype)
        else:
            q[name] = f[name] = t
    save_file(q, fp8 / "model.safetensors")
    save_file(f, ref / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": BLOCK}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    (fp8 / "model.safetensors.index.json").unlink(missing_ok=True)
    (ref / "model.safetensors.index.json").unlink(missing_ok=True)
    return fp8, ref, q


def _outputs(bundle):
    """Greedy tokens of two prompts, with their log-probabilities and the top two's."""
    import engc as engc_api
    llm = engc_api.LLM(str(bundle), device="cpu")
    params = engc_api.SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    seqs = [llm.engine.add_request(llm.encode(p, False), params) for p in ("The quick brown fox", "Hello")]
    llm.engine.run_to_completion()
    return [(s.output_ids, [[x.logprob] + [v for _, v in x.top] for x in s.logprobs]) for s in seqs]


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoint_reads_dequantized_and_builds_as_fp8_of_those_weights(family, tiny_dir, tmp_path):
    fp8, ref, q = fp8_pair(tiny_dir(family), tmp_path)
    ckpt = read_source(str(fp8))
    scaled = [n for n in q if n.endswith("_scale_inv")]
    assert scaled and not [n for n in ckpt.names() if n.endswith("_scale_inv")]
    for name in (n[:-len("_scale_inv")] for n in scaled):
        assert torch.equal(ckpt.get(name), dequantized(q[name], q[name + "_scale_inv"]))
    # --quant auto keeps it float8 (the CPU target emulates the GPU's FP8 GEMMs exactly): the same program and
    # weights as --quant fp8 of the dequantized float checkpoint, so the same tokens and log-probabilities
    build(str(fp8), tmp_path / "b_fp8", BuildOptions())
    build(str(ref), tmp_path / "b_ref", BuildOptions(quant="fp8"))
    manifest = json.loads((tmp_path / "b_fp8" / "manifest.json").read_text())
    assert manifest["quantization"]["source_format"] == "fp8 block-scaled"
    assert manifest["quantization"]["method"] == json.loads((tmp_path / "b_ref" / "manifest.json").read_text())[
        "quantization"]["method"]
    assert _outputs(tmp_path / "b_fp8") == _outputs(tmp_path / "b_ref")


def test_fp8_checkpoint_is_dequantized_where_the_targets_have_no_fp8():
    assert fp8_target_problem(("cpu",), "float32") is None and fp8_target_problem(("sm90",), "bfloat16") is None
    assert "sm80" in fp8_target_problem(("sm80", "sm90"), "bfloat16")


def test_malformed_fp8_checkpoints_are_one_line(tiny_dir, tmp_path):
    fp8, _, q = fp8_pair(tiny_dir("qwen3"), tmp_path)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"].pop("weight_block_size")
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(engc("build", fp8, "-o", tmp_path / "b"), "without a weight_block_size")
    cfg["quantization_config"]["weight_block_size"] = [32, 32]   # the scales are [16, 24] blocks'
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(engc("build", fp8, "-o", tmp_path / "b"), "does not match weight_block_size [32, 32]")
