"""GGUF files (llama.cpp's format) as a Checkpoint: HF config, HF-named float32 tensors, HF tokenizer files.

A GGUF stores the config as metadata under llama.cpp's key names, tensors under llama.cpp's names
(some quantized, some with rows reordered), and the tokenizer as vocabulary arrays. We translate all
three back to what an HF folder would hold, so the family mappings downstream never see GGUF.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engc.compiler.frontend import gguf_quant
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.gguf_tokenizer import tokenizer_files
from engc.errors import UserError

# GGUF architecture -> (HF model_type, HF class). llama.cpp writes Mistral 7B-style models as "llama",
# and those are the same network as Llama (llama.cpp runs no sliding window), so they map to llama.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
# llama.cpp writes Mixtral as "llama" with an expert count
_LLAMA_MOE = ("mixtral", "MixtralForCausalLM")
# whether the top-k expert weights are renormalized, where llama.cpp fixes it per architecture rather than
# writing expert_weights_norm (Mixtral's family always renormalizes)
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "olmoe": False}

# llama.cpp's converter reorders q/k rows (its rotary pairs adjacent dims; HF pairs i with i+d/2) only
# for the families it converts through its LlamaModel class; qwen2/qwen3 keep HF's order.
PERMUTED_QK = {"llama"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# stacked experts [E, rows, cols], named as transformers' fused parameters (no .weight); gate and up are two
# GGUF tensors and one HF one, gate rows first
_EXPERT_TENSORS = {"ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
                   "ffn_down_exps": "mlp.experts.down_proj"}
# tensor names of architectures that use a GGUF name for another HF tensor than _LAYER_TENSORS says:
# Gemma's four norms, Phi-3's fused qkv and gate_up (ffn_up holds both, gate rows first, as HF's gate_up_proj)
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_TENSORS = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS,
                       "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# llama.cpp's converter stores Gemma's norm weights with the 1 of (1 + weight) added; HF's have it not
_NORMS_PLUS_ONE = {"gemma2", "gemma3"}
# LongRoPE's per-frequency factors (Phi-3): tensors in GGUF, config.json's rope_scaling lists in HF
_ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Llama 3.x GGUFs carry their rope scaling only as a precomputed `rope_freqs` tensor; these are the
# parameter sets Meta shipped (3.1, then 3.2/3.3), tried in turn until one reproduces the tensor.
_LLAMA3_ROPE_CANDIDATES = [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
]


def read_gguf(path: Path, keep_quant: bool = False) -> Checkpoint:
    """keep_quant: 4-bit projections stay 4-bit (gguf_quant.py); else every tensor is dequantized."""
    path = Path(path)
    reader = _open(path)
    meta = _Metadata(reader, path.name)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path.name}: GGUF architecture '{arch}' is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    tensors = {t.name: t for t in reader.tensors}
    hf_config = _hf_config(meta, arch, tensors)
    loaders = _loaders(arch, tensors, hf_config, path.name, keep_quant)
    return Checkpoint(
        name=path.stem,
        hf_config=hf_config,
        loaders=loaders,
        tokenizer_files=tokenizer_files(path, meta, hf_config),
        source_files=[path],
    )


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad bytes
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"{path}: not a readable GGUF file ({reason})") from None


class _Metadata:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader, file_name: str):
        self.fields = reader.fields
        self.file_name = file_name

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if isinstance(value, float):
            # GGUF stores float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal that
            # round-trips through float32 is the value the model's config.json had.
            value = float(str(np.float32(value)))
        return value

    def token(self, token_id: int) -> str:
        return self.fields["tokenizer.ggml.tokens"].contents(token_id)

    def require(self, key: str):
        if key not in self.fields:
            raise UserError(f"{self.file_name}: GGUF metadata lacks '{key}'")
        return self.get(key)


def _hf_config(meta: _Metadata, arch: str, tensors: dict) -> dict:
    model_type, hf_class = ARCHITECTURES[arch]
    key = lambda name: meta.require(f"{arch}.{name}")  # noqa: E731
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    rotary_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dims != head_dim and arch in PERMUTED_QK:
        raise UserError(f"GGUF rotary width {rotary_dims} != head dim {head_dim}: partial rotary is not supported")
    if "token_embd.weight" not in tensors:
        raise UserError("GGUF file has no token_embd.weight tensor")
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        # an absent kv head count means plain multi-head attention, as in llama.cpp
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        # the embedding table is the model's vocabulary; metadata vocab_size is sometimes absent
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(meta, arch, tensors, config)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if rotary_dims != head_dim:
        config["partial_rotary_factor"] = rotary_dims / head_dim
    experts = meta.get(f"{arch}.expert_count", 0)
    if experts:
        _expert_config(meta, arch, config, experts, tensors)
    if arch in ("gemma2", "gemma3"):
        _gemma_config(meta, arch, config)
    return config


# llama.cpp scales q.k by 1/sqrt(head_dim) but for the 27B models (46 layers of Gemma 2, 62 of Gemma 3),
# whose query_pre_attn_scalar is hidden_size / heads: the same values their config.json files hold
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(meta: _Metadata, arch: str, config: dict) -> None:
    """Gemma's facts in llama.cpp's metadata and conventions: soft-caps (Gemma 2's defaults where absent),
    the sliding window, the attention scale, the local layers' rope base (fixed at 10000 by llama.cpp);
    the local/global pattern is the family's (families.py), as llama.cpp fixes it too."""
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config.pop("hidden_act")
    for key, default in (("attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
                         ("final_logit_softcapping", 30.0 if arch == "gemma2" else None)):
        config[key] = meta.get(f"{arch}.{key}", default)
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = window
    big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big \
        else config["head_dim"]
    if arch == "gemma3":
        config["rope_local_base_freq"] = 10000.0


def _expert_config(meta: _Metadata, arch: str, config: dict, experts: int, tensors: dict) -> None:
    if arch == "llama":
        config["model_type"], config["architectures"] = _LLAMA_MOE[0], [_LLAMA_MOE[1]]
        config["num_local_experts"] = experts
    else:
        config["num_experts"] = experts
        config["norm_topk_prob"] = meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])
    config["num_experts_per_tok"] = meta.require(f"{arch}.expert_used_count")
    expert_ffn = meta.get(f"{arch}.expert_feed_forward_length")
    if expert_ffn:
        config["moe_intermediate_size"] = expert_ffn
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if shared:
        config["shared_expert_intermediate_size"] = shared
    # a layer without a router keeps its dense MLP (Qwen-MoE's mlp_only_layers, which GGUF does not record)
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense:
        config["mlp_only_layers"] = dense
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        config["scoring_func"] = {2: "sigmoid"}.get(gating, f"llama.cpp gating function {gating}")


def _eos_ids(meta: _Metadata):
    """eos plus llama.cpp's end-of-turn/message ids: chat models stop on those too (e.g. Llama 3's <|eot_id|>)."""
    ids = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{k}")
        if value is not None and value not in ids:
            ids.append(value)
    return ids[0] if len(ids) == 1 else (ids or None)


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict, config: dict) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and factor:
        original = meta.get(f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"])
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    if kind not in ("none", "linear", "yarn"):
        raise UserError(f"GGUF rope scaling type '{kind}' is not supported")
    if "rope_freqs.weight" in tensors:
        return _llama3_rope_scaling(tensors["rope_freqs.weight"], config)
    if "rope_factors_short.weight" in tensors:
        factors = {key: np.array(tensors[name].data, dtype=np.float32).tolist()
                   for name, key in _ROPE_FACTOR_TENSORS.items() if name in tensors}
        return {"rope_type": "longrope", **factors,
                "original_max_position_embeddings": meta.require(f"{arch}.rope.scaling.original_context_length"),
                **({"attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}
                   if meta.get(f"{arch}.rope.scaling.attn_factor") is not None else {})}
    return None


def _llama3_rope_scaling(tensor, config: dict) -> dict:
    stored = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).double()
    for candidate in _LLAMA3_ROPE_CANDIDATES:
        expected = _llama3_rope_factors(config["head_dim"], config["rope_theta"], **candidate)
        if expected.shape == stored.shape and torch.allclose(stored, expected, rtol=1e-4):
            return {"rope_type": "llama3", **candidate}
    raise UserError("GGUF rope_freqs tensor matches no known Llama 3 rope scaling")


def _llama3_rope_factors(head_dim, theta, factor, low_freq_factor, high_freq_factor,
                         original_max_position_embeddings) -> torch.Tensor:
    """Per-frequency wavelength multipliers, as llama.cpp's converter computes them for Llama 3."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    return torch.where(wavelen < high_freq_wavelen, torch.ones_like(freqs),
                       torch.where(wavelen > low_freq_wavelen, torch.full_like(freqs, factor), mid))


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m.group(2) in _ARCH_LAYER_TENSORS.get(arch, {}):
        return f"model.layers.{m.group(1)}.{_ARCH_LAYER_TENSORS[arch][m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERT_TENSORS and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{_EXPERT_TENSORS[m.group(2)]}"
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


def _loaders(arch: str, tensors: dict, config: dict, file_name: str,
             keep_quant: bool) -> dict[str, Callable[[], torch.Tensor]]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    loaders, kept, dequantized = {}, {}, {}
    for gguf_name, tensor in tensors.items():
        if gguf_name == "rope_freqs.weight" or gguf_name in _ROPE_FACTOR_TENSORS:  # in config["rope_scaling"]
            continue
        hf_name = _hf_name(gguf_name, arch)
        if hf_name is None:
            raise UserError(f"{file_name}: GGUF tensor '{gguf_name}' has no mapping for architecture '{arch}'")
        if ".ffn_" in gguf_name and "_exps." in gguf_name:
            if tensor.tensor_type.name not in ("F32", "F16", "BF16"):
                dequantized[gguf_name] = tensor.tensor_type.name
            if ".ffn_up_exps." not in gguf_name:   # gate_up is loaded once, from both
                loaders[hf_name] = _expert_loader(tensors, gguf_name, file_name)
            continue
        row_groups = None
        if arch in PERMUTED_QK and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            row_groups = heads if ".attn_q." in gguf_name else kv_heads
        # the MoE op takes float weights, its shared expert's gate too (the shared expert is a dense MLP)
        if keep_quant and "shared_expert_gate" not in hf_name and gguf_quant.keeps(tensor, hf_name):
            reorder = (lambda a, groups=row_groups: _unpermute_rows(a, groups)) if row_groups else None
            loaders.update(gguf_quant.kept_loaders(tensor, hf_name.removesuffix(".weight"), reorder))
            kept[gguf_name] = tensor.tensor_type.name
            continue
        if tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            dequantized[gguf_name] = tensor.tensor_type.name
        loaders[hf_name] = _loader(tensor, row_groups, (1, -1) if ".ffn_gate_inp_shexp." in gguf_name else None,
                                   -1.0 if arch in _NORMS_PLUS_ONE and gguf_name.endswith("norm.weight") else 0.0)
    if kept:
        config["quantization_config"] = gguf_quant.quantization_config(kept, dequantized)
    return loaders


def _loader(tensor, row_groups: int | None, shape: tuple | None = None, offset: float = 0.0) -> Callable[[], torch.Tensor]:
    """shape: the HF shape where it differs (Qwen2-MoE's shared expert gate: [H] in GGUF, [1, H] in HF);
    offset: added to every weight (-1 for Gemma's norms, as transformers' GGUF reader does)."""
    def load() -> torch.Tensor:
        from gguf.quants import dequantize

        # GGUF lists dims fastest-first, so [in, out] there is HF's [out, in]
        hf_shape = shape or tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(hf_shape)
        if row_groups is not None:
            weights = _unpermute_rows(weights, row_groups)
        if offset:
            weights = weights + np.float32(offset)
        return torch.from_numpy(np.array(weights, dtype=np.float32))  # copy: the source is a read-only mmap

    return load


def _expert_loader(tensors: dict, gguf_name: str, file_name: str) -> Callable[[], torch.Tensor]:
    """Stacked experts as transformers' fused parameter: down [E, H, I]; gate_up [E, 2I, H] from ffn_gate_exps
    and ffn_up_exps. llama.cpp keeps HF's row order in experts (only attention q/k rows are permuted)."""
    parts = [gguf_name] if ".ffn_down_exps." in gguf_name else [gguf_name, gguf_name.replace("_gate_", "_up_")]
    for name in parts:
        if name not in tensors:
            raise UserError(f"{file_name}: GGUF file has '{gguf_name}' but not '{name}'")
    loads = [_loader(tensors[name], None) for name in parts]
    return lambda: torch.cat([load() for load in loads], dim=1)


def _unpermute_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head (2, d/2) -> (d/2, 2) row interleave, restoring HF's rotate-half layout."""
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
