"""AWQ (Lin et al. 2023): activation-aware per-input-channel scales, then a weight clipping search.

For each group of projections that read one input (qkv after input_layernorm, gate/up after the MLP's
input norm, down after up, o after v when the shapes allow; DeepSeek's latent attention: q or q_a and kv_a
after input_layernorm, q_b after q_a_layernorm, o after kv_b_proj's value rows), search s = x_mean^a /
w_mean^(1-a) over a grid of a in [0, 1), scoring each candidate by the MSE of the *block output*
(attention or MLP output, or the projection's own for down/o) with the scaled weights fake-quantized.
The best s is folded into the previous op (a norm's scale, w or Gemma's 1 + w, or projection rows) and
multiplied into the projections, so the float network is unchanged and only quantization error moves. Then, per output
channel and group, the clipping range max|w| * (1 - i/grid), i < grid/2, minimizing the projection's
output error on a token sample. This is the search of the paper and of AutoAWQ. An MoE layer's MLP is
experts.awq_experts's, on the pieces here (search_scale, scale_projections, clip_projections).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from engc.compiler.quantize.layer import ATTN_NORM, DecoderLayer, batched
from engc.compiler.quantize.mla_layer import KV_A, O, Q, Q_A, Q_A_NORM, Q_B, MlaLayer
from engc.compiler.quantize.rtn import fake_quantize, pad_groups

CLIP_TOKENS = 512       # tokens sampled for the clipping search
CLIP_MAX_SHRINK = 0.5
CLIP_ELEMENTS = 1 << 24  # elements of one clipping-search batch: bounds its memory (64 MB)


def awq_layer(layer: DecoderLayer, x: torch.Tensor, group_size: int, grid: int = 20) -> None:
    """A dense layer: rewrites layer.w in place (scales folded, weights clipped); x [B, T, D] is the layer's input.
    The MLP's search reads the attention as scaled but not yet clipped, as AWQ clips a layer's projections last."""
    scale_attention(layer, x, group_size, grid)
    awq_mlp(layer, x, group_size, grid)
    clip_attention(layer, x, group_size, grid)


def awq_attention(layer: DecoderLayer, x: torch.Tensor, group_size: int, grid: int = 20) -> None:
    """An MoE layer's attention, scaled and clipped as awq_layer's (experts.awq_experts does its MLP)."""
    scale_attention(layer, x, group_size, grid)
    clip_attention(layer, x, group_size, grid)


def awq_mlp(layer: DecoderLayer, x: torch.Tensor, group_size: int, grid: int) -> None:
    """A dense MLP, x the layer's input (its MLP reads layer.mlp_input(x), the attention as scaled so far):
    gate/up's scale over the MLP's input norm, down's over up's output, then the clipping of the three on their
    inputs as scaled. The norm's input is computed once (the searches change the norm, not the attention)."""
    x_mid = batched(layer.mlp_residual, x)
    m = batched(layer.mlp_in, x_mid)
    # as q/k/v's: gate/up's scale folds only into a norm before them, and a parallel block's norm took it with
    # q/k/v's (scale_attention)
    if layer.cfg.pre_norms and not layer.cfg.parallel_block:
        scale_projections(layer, layer.mlp_norm, ["mlp.gate_proj", "mlp.up_proj"], m,
                          lambda inp: batched(layer.mlp, inp), group_size, grid)
    m = batched(layer.mlp_in, x_mid)
    act = batched(layer.mlp_act, m)
    scale_projections(layer, "mlp.up_proj", ["mlp.down_proj"], act,
                      lambda inp: layer.linear(inp, "mlp.down_proj"), group_size, grid)
    m = batched(layer.mlp_in, x_mid)
    act = batched(layer.mlp_act, m)
    clip_projections(layer, (("mlp.gate_proj", m), ("mlp.up_proj", m), ("mlp.down_proj", act)), group_size, grid)


def scale_attention(layer: DecoderLayer, x: torch.Tensor, group_size: int, grid: int) -> None:
    if isinstance(layer, MlaLayer):
        return scale_latent_attention(layer, x, group_size, grid)
    h = batched(layer.attn_in, x)
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    if layer.cfg.parallel_block:   # Cohere: the norm feeds q/k/v and gate/up alike, so one scale serves all five
        scale_projections(layer, ATTN_NORM, qkv + ["mlp.gate_proj", "mlp.up_proj"], h,
                          lambda inp: batched(layer.attention, inp) + batched(layer.mlp, inp), group_size, grid)
    elif layer.cfg.pre_norms:   # without a norm before them (OLMo 2) there is nothing to fold q/k/v's scale into
        scale_projections(layer, ATTN_NORM, qkv, h, lambda inp: batched(layer.attention, inp), group_size, grid)
    if layer.cfg.num_heads == layer.cfg.num_kv_heads:  # v -> o folds only when v's outputs are o's inputs one to one
        ctx = batched(layer.attn_context, batched(layer.attn_in, x))
        scale_projections(layer, "self_attn.v_proj", ["self_attn.o_proj"], ctx,
                          lambda inp: layer.linear(inp, "self_attn.o_proj"), group_size, grid)


def scale_latent_attention(layer: MlaLayer, x: torch.Tensor, group_size: int, grid: int) -> None:
    """DeepSeek's attention, after AutoAWQ's deepseek_v2: q_proj (or q_a_proj) and kv_a_proj_with_mqa over the
    input norm's output, and q_b_proj over q_a_layernorm's, both scored on the attention's output (q_b_proj's
    error reaches it through the softmax); then o_proj over the attention's context, its scale folded into
    kv_b_proj's value rows (divide_values), which stay float."""
    h = batched(layer.attn_in, x)
    first = [Q_A if layer.cfg.q_lora_rank else Q, KV_A]
    scale_projections(layer, ATTN_NORM, first, h, lambda inp: batched(layer.attention, inp), group_size, grid)
    h = batched(layer.attn_in, x)
    if layer.cfg.q_lora_rank:
        def from_latent(latent: torch.Tensor) -> torch.Tensor:   # the attention's output, q_b_proj reading latent
            return batched(lambda lat, hs: layer.attn_out(layer.attn_context(hs, lat)), latent, h)
        scale_projections(layer, Q_A_NORM, [Q_B], batched(layer.q_latent, h), from_latent, group_size, grid)
    ctx = batched(layer.attn_context, h)
    scale_projections(layer, layer.divide_values, [O], ctx, lambda inp: layer.linear(inp, O), group_size, grid)


def clip_attention(layer: DecoderLayer, x: torch.Tensor, group_size: int, grid: int) -> None:
    """v (latent attention: kv_a_proj_with_mqa) and o clipped on their inputs as scaled; q and k are left alone
    (as in AWQ: their errors pass through the softmax, which a per-projection MSE does not see), and so are latent
    attention's q_proj, q_a_proj and q_b_proj."""
    h = batched(layer.attn_in, x)
    values = KV_A if isinstance(layer, MlaLayer) else "self_attn.v_proj"
    clip_projections(layer, ((values, h), ("self_attn.o_proj", batched(layer.attn_context, h))), group_size, grid)


def scale_projections(layer: DecoderLayer, prev: str | Callable, names: list[str], inp: torch.Tensor, block,
                      group_size: int, grid: int) -> None:
    """The scale of the projections `names`, which read inp (prev's output): each candidate's weights
    fake-quantized into layer.w and scored on block(inp), the best multiplied into them and divided out of prev,
    a norm's or a projection's name, or a function that divides prev's output by s (MlaLayer.divide_values)."""
    w = layer.w
    originals = {n: w[n + ".weight"] for n in names}

    def loss(s: torch.Tensor) -> float:
        for n, orig in originals.items():
            w[n + ".weight"] = orig  # frees the previous candidate before this one is made
            w[n + ".weight"] = fake_quantize(orig * s, group_size).div_(s)  # fresh: divided in place
        return (block(inp) - reference).float().pow(2).mean().item()

    with torch.no_grad():
        reference = block(inp)
        best = search_scale(inp, originals.values(), loss, group_size, grid)
    for n, orig in originals.items():
        w[n + ".weight"] = orig * best
    if callable(prev):
        prev(best)
    elif prev.endswith("layernorm"):
        layer.divide_norm(prev, best)
    else:  # a projection: its output rows (and bias) feed the scaled inputs
        w[prev + ".weight"] = w[prev + ".weight"] / best[:, None]
        if prev + ".bias" in w:
            w[prev + ".bias"] = w[prev + ".bias"] / best


def search_scale(inp: torch.Tensor, weights: Iterable[torch.Tensor], loss: Callable[[torch.Tensor], float],
                 group_size: int, grid: int) -> torch.Tensor:
    """AWQ's grid over a in [0, 1): s = x_mean^a / w_mean^(1-a), x_mean the mean |input| of each channel,
    w_mean the mean over all the weights' rows of |w| over its group's max|w|. The s of least loss(s)."""
    x_mean = inp.abs().reshape(-1, inp.shape[-1]).float().mean(0)
    w_mean = weight_mean(weights, group_size)
    best, best_loss = torch.ones_like(x_mean), float("inf")
    for i in range(grid):
        ratio = i / grid
        s = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        candidate = loss(s)
        if candidate < best_loss:
            best, best_loss = s, candidate
    return best


def weight_mean(weights: Iterable[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel, the mean over every row of the weights of |w| / max|w| of its group: summed one weight
    at a time, so no concatenation of them all (an MoE layer's experts) is ever made."""
    total, rows = 0, 0
    for weight in weights:
        g = pad_groups(weight.abs(), group_size).reshape(weight.shape[0], -1, group_size)
        g = g / g.amax(dim=-1, keepdim=True).clamp(min=1e-8)
        total = total + g.reshape(weight.shape[0], -1)[:, :weight.shape[1]].sum(0)
        rows += weight.shape[0]
    return total / rows


def clip_projections(layer: DecoderLayer, pairs, group_size: int, grid: int) -> None:
    """Each (projection, its input) of pairs: the projection's weight clipped (clip_weight)."""
    for name, inp in pairs:
        layer.w[name + ".weight"] = clip_weight(layer.w[name + ".weight"], inp, group_size, grid)


def clip_weight(weight: torch.Tensor, inp: torch.Tensor, group_size: int, grid: int) -> torch.Tensor:
    """Per (output channel, group): the clip max|w|*(1 - i/grid) whose fake-quantized weight changes
    the projection's output least on the sampled tokens. The output error of a group is x_g @ (q_g - w_g),
    so each candidate is one batched matmul over the groups ([G, T, g] @ [G, g, oc]), not a
    broadcast product of tokens x channels x inputs."""
    x = pad_groups(inp.reshape(-1, inp.shape[-1]).float(), group_size)  # zero inputs add nothing
    x = x[torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0])).long()]
    k_orig = weight.shape[1]
    padded = pad_groups(weight.float(), group_size)
    out_ch, k = padded.shape
    n_groups, tokens = k // group_size, x.shape[0]
    xg = x.reshape(tokens, n_groups, group_size).transpose(0, 1)      # [G, T, g]
    clipped = torch.empty_like(padded)  # written chunk by chunk: no list of chunks to concatenate
    chunk = max(1, CLIP_ELEMENTS // (tokens * n_groups))
    for rows, w in zip(range(0, out_ch, chunk), padded.split(chunk)):
        wg = w.reshape(w.shape[0], n_groups, group_size)              # [oc, G, g]
        org_max = wg.abs().amax(dim=-1, keepdim=True)                 # [oc, G, 1]
        best_err = torch.full((w.shape[0], n_groups), float("inf"))
        best_max = org_max.clone()
        for i in range(int(CLIP_MAX_SHRINK * grid)):
            max_val = org_max * (1 - i / grid)
            dq = fake_quantize(torch.clamp(wg, -max_val, max_val), group_size) - wg
            err = torch.bmm(xg, dq.permute(1, 2, 0)).pow_(2).mean(dim=1).T  # [oc, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[..., None], max_val, best_max)
        clipped[rows:rows + w.shape[0]] = torch.clamp(wg, -best_max, best_max).reshape(w.shape)
    return clipped[:, :k_orig].to(weight.dtype)
