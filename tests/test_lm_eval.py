"""lm-eval's `local-completions` against the engc server on the default model (SmolLM2-135M-Instruct): a
loglikelihood_rolling task and a multiple_choice task on local data (tests/data/lm_eval, no hub) run through
the harness, and every loglikelihood it computed from engc's echoed prompt logprobs equals HF transformers' on
the same GGUF, the same tokens, within 1e-3."""
import os
import textwrap
from pathlib import Path

import pytest
import torch

from engc.runtime.engine import EngineConfig
from live_server import LiveServer

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = {
    "engc_rolling": """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
          - metric: bits_per_byte
        """,
    "engc_multiple_choice": """
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
        """,
}
FILES = {"engc_rolling": "rolling.jsonl", "engc_multiple_choice": "multiple_choice.jsonl"}


@pytest.fixture(scope="module")
def lm_eval():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # local files only: nothing from the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")   # transformers reads the GGUF file with it
    from engc.compiler.frontend.default_model import default_gguf_path
    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([context + continuation])).logits[0, len(context) - 1:-1]
    logp = torch.log_softmax(logits.float(), -1)
    return float(logp.gather(1, torch.tensor(continuation)[:, None]).sum())


def test_lm_eval_loglikelihoods_equal_hf(default_bundle, lm_eval, hf, tmp_path):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    for name, body in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ntest_split: test\n"
                                               f"dataset_kwargs:\n  data_files:\n    test: {DATA / FILES[name]}\n"
                                               + textwrap.dedent(body))
    with LiveServer(default_bundle, EngineConfig(num_blocks=128), model_name="smollm2") as s:
        lm = LocalCompletionsAPI(base_url=s.url + "/v1/completions", model="smollm2", tokenizer_backend="huggingface",
                                 tokenizer=str(default_bundle / "tokenizer"), max_retries=1, timeout=300)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path)),
                                      log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
    results, samples = out["results"], out["samples"]
    assert results["engc_multiple_choice"]["acc,none"] >= 0.5   # the model knows most of these
    assert results["engc_rolling"]["word_perplexity,none"] > 1

    deltas = []
    for sample in samples["engc_rolling"]:
        text = sample["arguments"][0][0] if isinstance(sample["arguments"][0], (list, tuple)) else sample["arguments"][0]
        tokens = lm.tok_encode(text)
        expected = 0.0
        for window in map(make_disjoint_window, get_rolling_token_windows(
                tokens, prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)):
            context, continuation = window
            expected += hf_loglikelihood(hf, list(context), list(continuation))
        got = sample["filtered_resps"][0]
        got = got[0] if isinstance(got, (list, tuple)) else got
        deltas.append(abs(got - expected))
    for sample in samples["engc_multiple_choice"]:
        for (context, continuation), response in zip(sample["arguments"], sample["filtered_resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            deltas.append(abs(response[0] - hf_loglikelihood(hf, context_ids, continuation_ids)))
    assert len(deltas) == 3 + sum(len(s["arguments"]) for s in samples["engc_multiple_choice"])
    print(f"lm-eval loglikelihoods vs HF: {len(deltas)} values, max |delta| {max(deltas):.2e}")
    assert max(deltas) < 1e-3, deltas
