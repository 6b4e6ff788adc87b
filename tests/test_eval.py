"""engc eval: perplexity against HF transformers float32 on the real default model, the windows' coverage,
logits of chosen positions, and the progress it shows."""
from __future__ import annotations

import io
import json
import math

import pydoc_data.topics
import pytest
import torch
from click.testing import CliRunner

from engc.cli import main
from engc.progress import Progress, clock
from engc.runtime.eval import EvalOptions, _forward, perplexity, windows
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import load

# English prose that ships with Python: nothing to download, the same on every machine of a Python version
TEXT = pydoc_data.topics.topics["assignment"]
SHORT = " ".join(["The quick brown fox jumps over the lazy dog. Paris is the capital of France."] * 8)


def hf_perplexity(model, ids: list[int], window: int, stride: int) -> float:
    """The Hugging Face sliding-window recipe, written out against the HF model's full logits."""
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        first = max(prev_end, begin + 1)
        with torch.no_grad():
            logits = model(torch.tensor([ids[begin:end]])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(first, end):
            nll -= float(logp[t - begin - 1, ids[t]])
        scored += end - first
        prev_end = end
        if end == len(ids):
            break
    assert scored == len(ids) - 1
    return math.exp(nll / scored)


def test_perplexity_matches_transformers_float32_on_default_model(default_bundle):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF model
    from engc.compiler.frontend.default_model import default_gguf_path
    gguf = default_gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                            dtype=torch.float32).eval()
    model = load(default_bundle)
    opts = EvalOptions(window=256, stride=128, max_tokens=700)
    ours = perplexity(model, TEXT, opts)
    ids = model.tokenizer.encode(TEXT, add_special_tokens=False)[:700]
    assert ours["tokens"] == 700 and ours["scored"] == 699 and ours["windows"] == 5
    expected = hf_perplexity(ref, ids, 256, 128)
    assert 3 < expected < 100          # real English text under a real model
    assert ours["ppl"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("n,window,stride", [(2, 512, 256), (700, 256, 128), (1000, 512, 512), (513, 512, 1),
                                             (100, 16, 5)])
def test_windows_score_every_token_once_with_its_context(n, window, stride):
    """With stride == window a window's first token has nothing before it in the window: no logits predict
    it, and it is left out, as in the Hugging Face recipe."""
    plan = windows(n, window, stride)
    targets = [t for w in plan for t in range(w.first, w.end)]
    assert targets == sorted(set(targets))
    assert set(range(1, n)) - set(targets) == ({w.begin for w in plan[1:]} if stride == window else set())
    for w in plan:
        assert w.begin < w.first <= w.end and w.end - w.begin <= window
        assert w.begin % stride == 0
    assert plan[-1].end == n


def test_forward_logits_at_chosen_positions_are_rows_of_the_full_forward(tiny_bundle):
    model = load(tiny_bundle("llama"))
    ids = model.tokenizer.encode(SHORT, add_special_tokens=False)[:40]
    kv = KVCache(model.config, 4, model.block_size, model.dtype, model.device)
    full = _forward(model, kv, ids)
    part = _forward(model, kv, ids, range(17, 39))
    assert full.shape[0] == 40 and part.shape[0] == 22
    torch.testing.assert_close(part, full[17:39], rtol=1e-5, atol=1e-5)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_counts_windows_and_tokens_with_an_eta(tiny_bundle):
    stream = FakeTerminal()
    result = perplexity(load(tiny_bundle("llama")), SHORT, EvalOptions(window=64, stride=32),
                        Progress(stream=stream))
    lines = stream.getvalue().split("\r\033[K")[1:]
    total, last = result["windows"], result["tokens"] - 1
    assert total > 2 and len(lines) == total + 1
    assert f"] 1/{total} windows, " in lines[0] and ", ETA " in lines[0]
    assert f"] {total}/{total} windows, {last}/{last} tokens scored, ETA 0:00" in lines[-2]
    assert lines[-1].startswith(f"perplexity: {total}/{total} windows, {last}/{last} tokens scored in ")
    assert lines[-1].endswith("s\n")


def test_eval_cli_progress_is_one_stderr_line_off_a_terminal_and_none_with_json(tiny_bundle, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(SHORT)
    args = ["eval", str(tiny_bundle("llama")), "--ppl", str(text), "--window", "64", "--stride", "32"]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 0, plain.output
    assert plain.stderr.count("\n") == 1 and plain.stderr.startswith("perplexity: ")
    assert plain.stdout.startswith("perplexity ")
    as_json = CliRunner().invoke(main, [*args, "--json"])
    assert as_json.exit_code == 0 and as_json.stderr == ""
    assert json.loads(as_json.stdout)["scored"] == int(plain.stderr.split("/")[2].split()[0])


@pytest.mark.parametrize("seconds,text", [(0, "0:00"), (59.4, "0:59"), (61, "1:01"), (3725, "1:02:05")])
def test_clock(seconds, text):
    assert clock(seconds) == text
