"""The model families engc knows: each is a few facts on top of the shared decoder mapping."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (frontend/moe.py lowers it): where config.json and the checkpoint keep it."""
    intermediate_key: str = "moe_intermediate_size"   # config.json key of each expert's intermediate size
    # per-expert checkpoint tensors: model.layers.{i}.{block}.experts.{e}.{gate,up,down}.weight
    block: str = "mlp"
    gate_up_down: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # the top-k weights divided by their sum: always (True), never (False), or as a config.json key says
    renormalize: bool | str = "norm_topk_prob"
    # config.json key of the shared expert's intermediate size (Qwen2-MoE: one more expert on every token,
    # behind a sigmoid gate); None: the family has none
    shared_expert_key: str | None = None
    # some layers keep a dense MLP (Qwen-MoE's decoder_sparse_step and mlp_only_layers)
    dense_layers: bool = False
    # each expert's output is weighted by its float32 routing weight (Mixtral), not one cast to the model
    # dtype first (Qwen-MoE, OLMoE): a bfloat16 model rounds differently
    float32_weights: bool = False
    # DeepSeek's routing (kernels/moe): "deepseek_v2" (softmax scores; topk_method greedy or group_limited_greedy,
    # best expert a group) or "deepseek_v3" (noaux_tc: sigmoid scores plus the e_score_correction_bias choose,
    # best two a group); both scale by routed_scaling_factor. "ernie4_5": softmax scores plus the correction bias
    # choose, the unbiased scores weigh. None: softmax top-k as above
    routing: str | None = None
    # the router's correction bias (a routing that has one), relative to the MoE block
    correction_bias: str = "gate.e_score_correction_bias"
    # config.json key of the number of always-on, ungated shared experts of moe_intermediate_size each (DeepSeek)
    shared_experts_count_key: str | None = None
    # config.json key of the number of leading layers that keep a dense MLP (DeepSeek's first_k_dense_replace)
    first_dense_key: str | None = None
    # the routing weights: softmax over all experts, then the top-k (True), or the top-k logits, then their
    # softmax (False: Granite MoE)
    softmax_first: bool = True
    # config.json keys of the first and last MoE layer and the interval between MoE layers (ERNIE 4.5's
    # moe_layer_start_index, moe_layer_end_index, moe_layer_interval; the others keep a dense MLP)
    layer_range_keys: tuple[str, str, str] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False
    qk_norm: bool = False
    # config.json key that, when true, turns the per-head q/k norm on (Command R+'s, GLM-4.5's use_qk_norm)
    qk_norm_key: str | None = None
    # config.json key that, when true, turns the sliding window on (None: always on when set)
    sliding_window_switch: str | None = None
    # OLMoE: q and k normed each as one vector over all heads (RMSNorm of the whole projection), not per head
    qk_norm_projection: bool = False
    experts: Experts | None = None    # a mixture-of-experts MLP in place of the dense one
    # checkpoint tensor names: "llama" (HF Llama's), "phi3" (fused qkv_proj and gate_up_proj) or "internlm2"
    # (grouped wqkv, w1/w3/w2); frontend/layouts.py maps each onto Llama's
    layout: str = "llama"
    qkv_bias_key: str = "attention_bias"    # config.json key that puts a bias on q, k and v
    # config.json keys that must be false or absent: biases engc has no input for (InternLM's o_proj/MLP `bias`)
    refused_true: tuple[str, ...] = ()
    # Gemma: every RMSNorm scales by (1 + weight); each block also norms its attention and MLP outputs
    # before the residual add ("sandwich"); the embedding is multiplied by sqrt(hidden_size)
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    # OLMo 2: no norm before the attention and the MLP, which read the residual stream itself; their outputs
    # are normed (sandwich_norms' post norms) before the residual add
    pre_norms: bool = True
    scaled_embedding: bool = False
    # one global layer every N, the others local (sliding window), for a config.json without layer_types
    # (0: every layer alike)
    sliding_window_pattern: int = 0
    # a multimodal config whose text_config is the model engc builds (Gemma 3: the vision tower is left out)
    text_config: bool = False
    # transformers' config-class defaults of keys that released config.json files leave out
    defaults: tuple[tuple[str, object], ...] = ()
    bos_always: bool = False        # every sequence starts with BOS, whatever tokenizer.json says (bos.py)
    # multi-head latent attention (DeepSeek-V2/V3, frontend/mla.py): q (optionally through q_lora_rank), a
    # kv_lora_rank latent and a shared rope key cached per token; rope_interleave: the rotated dims are pairs
    # (x0, x1), (x2, x3)... (always for V2, as config.json's rope_interleave says for V3)
    latent_attention: bool = False
    rope_interleave: bool | str = False
    # SmolLM3: config.json's no_rope_layers says per layer whether its attention rotates (1) or not (0: NoPE);
    # absent, every no_rope_layer_interval-th layer is NoPE. A sliding window, where use_sliding_window turns it
    # on, applies to the layers layer_types names sliding_attention (by default the NoPE ones)
    nope_layers: bool = False
    # hybrid attention whose global layers rotate nothing: EXAONE 4's where config.json sets a sliding_window
    # ("window_set"), Cohere 2's always, every layer without a window then ("always")
    nope_global_layers: str | None = None
    # Cohere: LayerNorm (mean subtracted, no bias; eps config.json's layer_norm_eps) in place of RMSNorm; the
    # attention and the MLP read the same normed input and both add to the residual; logits times logit_scale;
    # its q/k norm (Command R+'s) LayerNorms each head with a weight of its own
    cohere: bool = False
    # Granite: config.json's embedding_multiplier, attention_multiplier (the q.k scale itself),
    # residual_multiplier (each block's output before the residual add) and logits_scaling (the logits' divisor)
    multipliers: bool = False


_GEMMA = dict(norm_unit_offset=True, sandwich_norms=True, scaled_embedding=True, bos_always=True)
# Gemma3TextConfig's defaults: a gemma3 checkpoint's text_config lists only what differs from them
_GEMMA3_DEFAULTS = (("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
                    ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                    ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"),
                    ("max_position_embeddings", 131072), ("rms_norm_eps", 1e-6), ("rope_theta", 1_000_000.0),
                    ("rope_local_base_freq", 10_000.0), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                    ("tie_word_embeddings", True), ("bos_token_id", 2), ("eos_token_id", 1))
_GRANITE_DEFAULTS = (("embedding_multiplier", 1.0), ("attention_multiplier", 1.0), ("residual_multiplier", 1.0),
                     ("logits_scaling", 1.0))
_GEMMA2_DEFAULTS = (("hidden_activation", "gelu_pytorch_tanh"), ("head_dim", 256), ("rms_norm_eps", 1e-6),
                    ("query_pre_attn_scalar", 256), ("sliding_window", 4096), ("final_logit_softcapping", 30.0),
                    ("attn_logit_softcapping", 50.0), ("tie_word_embeddings", True))



def _DEEPSEEK(**facts) -> Experts:
    return Experts(shared_experts_count_key="n_shared_experts", first_dense_key="first_k_dense_replace", **facts)


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2", qkv_bias=True, sliding_window_switch="use_sliding_window"),
    "qwen3": Family("qwen3", qk_norm=True, sliding_window_switch="use_sliding_window"),
    "mixtral": Family("mixtral", experts=Experts(intermediate_key="intermediate_size", block="block_sparse_moe",
                                                 gate_up_down=("w1", "w3", "w2"), renormalize=True,
                                                 float32_weights=True)),
    "qwen2_moe": Family("qwen2_moe", qkv_bias=True, sliding_window_switch="use_sliding_window",
                        experts=Experts(shared_expert_key="shared_expert_intermediate_size", dense_layers=True)),
    "qwen3_moe": Family("qwen3_moe", qk_norm=True, sliding_window_switch="use_sliding_window",
                        experts=Experts(dense_layers=True)),
    "olmoe": Family("olmoe", qk_norm_projection=True, experts=Experts(intermediate_key="intermediate_size")),
    "olmo2": Family("olmo2", qk_norm_projection=True, sandwich_norms=True, pre_norms=False),
    # OLMo 3: OLMo 2's block with three local layers in four, the global ones' rope alone scaled (YaRN)
    "olmo3": Family("olmo3", qk_norm_projection=True, sandwich_norms=True, pre_norms=False, sliding_window_pattern=4,
                    refused_true=("attention_bias",)),
    # Seed-OSS: Llama's network with a bias on q, k and v (attention_bias; attention_out_bias and mlp_bias refused)
    "seed_oss": Family("seed_oss", defaults=(("attention_bias", True),),
                       refused_true=("attention_out_bias", "mlp_bias")),
    # GLM-4 (-0414): Gemma's four norms (layouts.py renames them), fused gate_up, half of each head rotated in
    # interleaved pairs, a bias on q, k and v (attention_bias, true in its configs)
    "glm4": Family("glm4", layout="glm4", sandwich_norms=True, rope_interleave=True,
                   defaults=(("attention_bias", True), ("partial_rotary_factor", 0.5))),
    # attention_bias puts one on o_proj too, which the lowering has no input for
    "cohere": Family("cohere", cohere=True, rope_interleave=True, qk_norm_key="use_qk_norm",
                     refused_true=("attention_bias",),
                     defaults=(("logit_scale", 0.0625), ("layer_norm_eps", 1e-5), ("tie_word_embeddings", True))),
    # Cohere 2 (Command R7B, Command A): Cohere's block, three local layers in four, the global ones NoPE
    "cohere2": Family("cohere2", cohere=True, rope_interleave=True, sliding_window_pattern=4,
                      nope_global_layers="always", refused_true=("attention_bias",),
                      defaults=(("logit_scale", 0.0625), ("layer_norm_eps", 1e-5), ("tie_word_embeddings", True),
                                ("sliding_window", 4096))),
    # ERNIE 4.5 (dense): Llama's network rotating interleaved pairs of the whole head
    "ernie4_5": Family("ernie4_5", rope_interleave=True, refused_true=("use_bias",)),
    # ERNIE 4.5 MoE (21B-A3B, 300B-A47B): its dense block around experts chosen by softmax scores plus a
    # correction bias (moe_statics), renormalized; shared experts; MoE layers in a range of layers.
    # Defaults: transformers' Ernie4_5_MoeConfig's
    "ernie4_5_moe": Family("ernie4_5_moe", rope_interleave=True, refused_true=("use_bias",),
                           defaults=(("moe_num_experts", 64), ("moe_k", 6), ("moe_intermediate_size", 1536),
                                     ("moe_num_shared_experts", 2), ("moe_layer_start_index", 1),
                                     ("moe_layer_interval", 1), ("tie_word_embeddings", True)),
                           experts=Experts(routing="ernie4_5", renormalize=True,
                                           correction_bias="moe_statics.e_score_correction_bias",
                                           shared_experts_count_key="moe_num_shared_experts",
                                           layer_range_keys=("moe_layer_start_index", "moe_layer_end_index",
                                                             "moe_layer_interval"))),
    # EXAONE 4: OLMo 2's norms (none before, one after each block) with per-head q/k norms; with a window,
    # three local layers in four (or config.json's layer_types) and global layers without rotary embedding
    "exaone4": Family("exaone4", qk_norm=True, sandwich_norms=True, pre_norms=False, sliding_window_pattern=4,
                      nope_global_layers="window_set"),
    # V2's router never renormalizes (HF's ignores norm_topk_prob); defaults: transformers' config classes'
    "deepseek_v2": Family("deepseek_v2", latent_attention=True, rope_interleave=True,
                          defaults=(("first_k_dense_replace", 0), ("n_shared_experts", 2), ("topk_method", "greedy"),
                                    ("routed_scaling_factor", 1.0)),
                          experts=_DEEPSEEK(routing="deepseek_v2", renormalize=False)),
    "deepseek_v3": Family("deepseek_v3", latent_attention=True, rope_interleave="rope_interleave",
                          defaults=(("rope_interleave", True), ("norm_topk_prob", True), ("n_group", 8),
                                    ("topk_group", 4), ("routed_scaling_factor", 2.5), ("first_k_dense_replace", 3),
                                    ("n_shared_experts", 1)),
                          experts=_DEEPSEEK(routing="deepseek_v3")),
    # GLM-4.5 / 4.6 (glm4_moe): grouped-query attention over half of each head's dims (rotate-half), q/k/v
    # biases, Qwen3's q/k norm where use_qk_norm; DeepSeek-V3's experts and routing (multi-token prediction
    # layers past num_hidden_layers are not the decoder's). Defaults: transformers' Glm4MoeConfig's
    "glm4_moe": Family("glm4_moe", qk_norm_key="use_qk_norm",
                       defaults=(("partial_rotary_factor", 0.5), ("norm_topk_prob", True), ("n_group", 1),
                                 ("topk_group", 1), ("routed_scaling_factor", 1.0), ("first_k_dense_replace", 1),
                                 ("n_shared_experts", 1)),
                       experts=_DEEPSEEK(routing="deepseek_v3")),
    "gemma2": Family("gemma2", sliding_window_pattern=2, defaults=_GEMMA2_DEFAULTS, **_GEMMA),
    "gemma3_text": Family("gemma3_text", qk_norm=True, sliding_window_pattern=6, defaults=_GEMMA3_DEFAULTS,
                          **_GEMMA),
    "gemma3": Family("gemma3", text_config=True),   # its text_config is a gemma3_text model
    "mistral3": Family("mistral3", text_config=True),   # Mistral Small 3.x: its text_config is a mistral model
    # Ministral 3 (a mistral3 checkpoint's text_config): Mistral's network with YaRN and Llama 4's query
    # temperature, which the context limit keeps at 1 (rope.context_limit)
    "ministral3": Family("ministral3"),
    "phi3": Family("phi3", layout="phi3"),
    "internlm3": Family("internlm3", qkv_bias_key="qkv_bias", refused_true=("bias",)),
    "internlm2": Family("internlm2", layout="internlm2", refused_true=("bias",)),
    "smollm3": Family("smollm3", sliding_window_switch="use_sliding_window", nope_layers=True,
                      defaults=(("no_rope_layer_interval", 4),), refused_true=("attention_bias", "mlp_bias")),
    # Granite MoE (granite-3.x-*-a*m): Granite's multipliers over stacked experts (layouts.py names them as
    # transformers' fused experts), routed by the softmax of the top-k logits
    "granitemoe": Family("granitemoe", layout="granitemoe", multipliers=True, refused_true=("attention_bias",),
                         defaults=_GRANITE_DEFAULTS,
                         experts=Experts(intermediate_key="intermediate_size", renormalize=False,
                                         softmax_first=False)),
    "granite": Family("granite", multipliers=True, refused_true=("attention_bias", "mlp_bias"),
                      defaults=_GRANITE_DEFAULTS),
}


def family_of(hf_config: dict) -> Family:
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        arch = ",".join(hf_config.get("architectures") or []) or model_type
        from engc.errors import UserError
        raise UserError(f"unsupported architecture '{arch}' (model_type '{model_type}'); "
                        f"supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]
