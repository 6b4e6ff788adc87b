"""The int4 math on its own: packing layouts, RTN, GPTQ and AWQ against each other on synthetic data."""
import torch

from engc.compiler.quantize.awq import clip_weight
from engc.compiler.quantize.formats import AWQ_ORDER, pack_columns, pack_rows, to_awq, to_gptq, unpack_columns, unpack_rows
from engc.compiler.quantize.gptq import Hessian, gptq_quantize
from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.rope import inv_freq
from engc.compiler.quantize.layer import DecoderLayer
from engc.compiler.quantize.options import QuantOptions
from engc.compiler.quantize.rtn import params, quantize_rtn, quantize_with
from engc.compiler.quantize.stream import gptq_layer
from engc.kernels.int4_linear import dequantize, int4_linear, pack_int4, unpack_int4


def correlated_inputs(n=2048, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(n, k, generator=g) @ mix
    x[:, :8] *= 20  # a few outlier channels, as real activations have
    return x


def test_pack_roundtrips():
    q = torch.randint(0, 16, (64, 96), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert torch.equal(unpack_rows(pack_rows(q)), q)
    # the engc layout: nibble j of word 4c + i holds input 32c + 4j + i of the row
    words = pack_int4(torch.arange(32, dtype=torch.uint8)[None, :] % 16)
    assert [int(w) & 0xFFFFFFFF for w in words[0]] == [sum(((4 * j + i) % 16) << (4 * j) for j in range(8))
                                                       for i in range(4)]
    assert torch.equal(unpack_columns(pack_columns(q, AWQ_ORDER), AWQ_ORDER), q)
    words = pack_columns(torch.arange(8, dtype=torch.uint8)[None, :], AWQ_ORDER)
    assert int(words) == sum(c << (4 * i) for i, c in enumerate(AWQ_ORDER))  # AutoAWQ's interleave


def test_formats_hold_the_same_weight():
    w = torch.randn(96, 128)
    qw = quantize_rtn(w, 32)
    ref = qw.dequantize()
    assert (ref - w).abs().max() <= qw.scales.max() * 0.5 + 1e-6
    a, g = to_awq(qw), to_gptq(qw)
    awq = (unpack_columns(a["qweight"], AWQ_ORDER).float()
           - unpack_columns(a["qzeros"], AWQ_ORDER).float().repeat_interleave(32, 0)) * a["scales"].float().repeat_interleave(32, 0)
    z = ((unpack_columns(g["qzeros"]).long() + 1) & 15).float()
    gptq = (unpack_rows(g["qweight"]).float() - z[g["g_idx"].long()]) * g["scales"].float()[g["g_idx"].long()]
    for dense in (awq, gptq):
        assert torch.allclose(dense.T, ref, atol=1e-2 * ref.abs().max())


def test_int4_linear_reference_matches_dense():
    w = torch.randn(64, 128)
    qw = quantize_rtn(w, 64)
    qweight = pack_int4(qw.q)
    x = torch.randn(5, 128)
    y = int4_linear(x, qweight, qw.scales, qw.zeros, group_size=64)
    assert torch.allclose(y, x @ qw.dequantize().T, atol=1e-4)
    assert torch.allclose(dequantize(qweight, qw.scales, qw.zeros, 64), qw.dequantize())


def _layer():
    """A [128, 256] weight, the Hessian of correlated inputs x, and the layer-output error of a quantized weight."""
    x = correlated_inputs()
    w = torch.randn(128, 256)
    h = Hessian(256)
    for chunk in x.split(512):
        h.add(chunk)
    ref = x @ w.T
    return w, h, lambda qw: ((x @ qw.dequantize().T - ref) ** 2).mean().item()


def test_gptq_beats_rtn_on_layer_output():
    w, h, err = _layer()
    rtn = err(quantize_rtn(w, 64))
    gptq = err(gptq_quantize(w, h.H, 64))
    act = gptq_quantize(w, h.H, 64, act_order=True)
    assert gptq < 0.8 * rtn and err(act) < 0.8 * rtn
    assert not torch.equal(act.g_idx.long(), torch.arange(256) // 64)  # act-order really permuted


def test_act_order_with_static_groups_keeps_channel_order_groups():
    """Static groups: the columns are quantized in act-order, but each group is the channel-order one with its
    range from the weight before any error reached it, so g_idx is plain (the bundle runs no gather) and
    every code is exact against the dequantized weight; it still beats RTN on the layer output."""
    from engc.compiler.quantize.rtn import params
    w, h, err = _layer()
    static = gptq_quantize(w, h.H, 64, act_order=True, static_groups=True)
    assert torch.equal(static.g_idx.long(), torch.arange(256) // 64)
    for g in range(4):
        scale, zero = params(w[:, 64 * g:64 * (g + 1)])
        assert torch.equal(static.scales[:, g], scale) and torch.equal(static.zeros[:, g].float(), zero)
    assert err(static) < 0.8 * err(quantize_rtn(w, 64))
    assert not torch.equal(static.q, gptq_quantize(w, h.H, 64).q)   # the act-order sweep, not the plain one


def test_awq_clipping_does_not_hurt():
    x = correlated_inputs(k=128)
    w = torch.randn(64, 128)
    w[0, 0] = 12.0  # an outlier weight worth clipping
    ref = x @ w.T
    err = lambda v: ((x @ quantize_rtn(v, 32).dequantize().T - ref) ** 2).mean().item()  # noqa: E731
    assert err(clip_weight(w, x, 32, grid=20)) <= err(w)


def test_ragged_last_group_is_zero_padding():
    """576 inputs in groups of 128 (SmolLM2's hidden size): the last group holds 64 channels."""
    x = correlated_inputs(k=576)
    w = torch.randn(64, 576)
    qw = quantize_rtn(w, 128)
    assert qw.scales.shape == (64, 5) and (qw.dequantize() - w).abs().max() <= qw.scales.max() / 2 + 1e-6
    padded = quantize_rtn(torch.nn.functional.pad(w, (0, 64)), 128)
    assert torch.equal(padded.q[:, :576], qw.q) and torch.equal(padded.scales, qw.scales)
    h = Hessian(576)
    h.add(x)
    g = gptq_quantize(w, h.H, 128)
    assert g.scales.shape == (64, 5)
    y = x @ w.T
    assert ((x @ g.dequantize().T - y) ** 2).mean() < ((x @ qw.dequantize().T - y) ** 2).mean()
    qweight = pack_int4(qw.q)
    assert torch.allclose(dequantize(qweight, qw.scales, qw.zeros, 128), qw.dequantize())


def obq_reference(w, hessian, group_size, damp=0.01):
    """GPTQ's objective solved the slow way (the OBQ update of Frantar et al.), in float64: after each
    column, its rounding error is spread over the later columns through the inverse Hessian, from which
    that column is then eliminated (a Schur complement). No Cholesky, no lazy blocks."""
    W, H = w.double().clone(), hessian.double().clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    Hinv, Q = torch.linalg.inv(H), torch.zeros_like(W)
    for j in range(W.shape[1]):
        if j % group_size == 0:
            scale, zero = params(W[:, j:j + group_size])
        Q[:, j] = (quantize_with(W[:, j].clone(), scale, zero) - zero) * scale
        W[:, j:] -= torch.outer((W[:, j] - Q[:, j]) / Hinv[j, j], Hinv[j, j:])
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return Q


def test_gptq_is_the_obq_solution():
    """320 columns: three lazy blocks of 128, the last one short, and groups inside and across them."""
    x = correlated_inputs(n=1200, k=320)
    w = torch.randn(48, 320, generator=torch.Generator().manual_seed(2))   # seeded: not whatever ran before
    h = Hessian(320)
    h.add(x)
    for g in (32, 128):
        assert torch.allclose(gptq_quantize(w, h.H, g).dequantize().double(), obq_reference(w, h.H, g), atol=1e-4)


def test_gptq_beats_rtn_on_held_out_layer_output():
    """A whole decoder layer quantized stage by stage as engc quantize does (Hessians from the inputs the
    already quantized projections produce), scored on inputs it was not calibrated on."""
    cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=False, qk_norm=False,
                      rope_scaling=None, sliding_window=0, bos_token_id=0, eos_token_ids=(1,))
    gen = torch.Generator().manual_seed(1)
    shapes = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
              "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
              "mlp.down_proj": (128, 256)}
    weights = {n + ".weight": torch.randn(*s, generator=gen) * 0.05 for n, s in shapes.items()}
    weights.update({"input_layernorm.weight": torch.ones(128), "post_attention_layernorm.weight": torch.ones(128)})
    embed = correlated_inputs(n=512, k=128, seed=2)  # token embeddings with outlier channels
    calib = embed[torch.randint(0, 512, (16, 64), generator=gen)]
    held = embed[torch.randint(0, 512, (8, 64), generator=gen)]
    rope = inv_freq(32, 10000.0, None)
    reference = DecoderLayer(cfg, dict(weights), rope).forward(held)

    def held_out_error(method, g):
        layer = DecoderLayer(cfg, dict(weights), rope)
        if method == "gptq":
            gptq_layer(layer, calib, QuantOptions(method="gptq", group_size=g), lambda qw: {})
        else:
            for n in shapes:
                layer.w[n + ".weight"] = quantize_rtn(layer.w[n + ".weight"], g).dequantize()
        return (layer.forward(held) - reference).pow(2).mean().item()

    with torch.no_grad():
        for g in (128, 32):
            gptq, rtn = held_out_error("gptq", g), held_out_error("rtn", g)
            assert gptq < 0.5 * rtn, (g, gptq, rtn)
