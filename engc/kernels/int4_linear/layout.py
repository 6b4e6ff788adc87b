"""The engc int4 layout (what every AWQ/GPTQ checkpoint is repacked into), its packing and its CPU reference
(dequantize: what the GPU dequant kernels write, bit for bit). For a K-in, N-out projection,
N-major like a torch Linear weight, so a decode GEMV reads each output row as one contiguous stream:
  qweight int32 [N, K // 8]   chunk c (inputs 32c .. 32c+31) is words 4c .. 4c+3 (16 bytes); nibble j
                              (bits 4j..4j+3) of word 4c+i holds q[n, 32c + 4j + i]
  scales  float [N, ceil(K / group_size)]   (the last group may be short: K need not divide)
  zeros   uint8 [N, ceil(K / group_size)]   zero points in [0, 15]
  offsets float [N, ceil(K / group_size)]   optional: a group's float minimum (GGUF Q4_1 / Q4_K), which no
                                            integer zero point can hold exactly
  W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g] (+ offsets[n, k // g])
Why the interleave: one 16-byte load gives a thread 32 weights of one row, and nibble j of its four words
holds 4 consecutive inputs, so the matching x is one 8-byte load per nibble position. K % 32 == 0 and
a group size that is a multiple of 32 (or covers all of K) keep every chunk inside one group.
Fused projections (qkv, gate_up) concatenate along N (dim 0 of every tensor). act_order checkpoints
(GPTQ desc_act) have their input channels sorted by group at build time; perm (int64 [K]) then says
which input channel each sorted column reads: y = x[:, perm] @ W^T.
"""
import torch

# The layout's name in the manifest (quantization.layout). Bumped whenever the packing changes, so a
# runtime never reads a bundle packed another way.
LAYOUT = "engc-int4-nmajor"
# The same layout with per-group float offsets on some projections (GGUF Q4_1 / Q4_K): its own name, so a
# runtime that cannot add them refuses the bundle in one line instead of failing at its first step.
LAYOUT_WITH_OFFSETS = LAYOUT + "-offsets"
LAYOUTS = (LAYOUT, LAYOUT_WITH_OFFSETS)

PACK = 8    # nibbles per int32 word
CHUNK = 32  # inputs per 16-byte chunk (4 words)


def check_shape(k: int, group_size: int) -> str | None:
    """Why the engc int4 layout cannot hold a K-in projection in groups of group_size, or None."""
    if k % CHUNK:
        return f"{k} inputs are not a multiple of {CHUNK}, which the engc int4 layout needs"
    if group_size % CHUNK and group_size < k:
        return f"int4 group size {group_size} is not a multiple of {CHUNK}, which the engc int4 layout needs"
    return None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8-valued [N, K] (values 0..15), K % 32 == 0 -> int32 [N, K // 8] in the engc layout."""
    n, k = q.shape
    assert k % CHUNK == 0, k
    slots = q.reshape(n, k // CHUNK, PACK, 4).to(torch.int32)   # [N, chunk, j, i] = q[n, 32c + 4j + i]
    words = torch.zeros(n, k // CHUNK, 4, dtype=torch.int32, device=q.device)
    for j in range(PACK):  # int32 shifts wrap in two's complement: nibble 7 lands in the sign bit
        words |= slots[:, :, j] << (4 * j)
    return words.reshape(n, k // PACK)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> uint8 [N, K]."""
    n, kw = qweight.shape
    shifts = (torch.arange(PACK, dtype=torch.int32, device=qweight.device) * 4).view(1, 1, PACK, 1)
    words = qweight.reshape(n, kw // 4, 1, 4)                        # [N, chunk, 1, i]
    return ((words >> shifts) & 0xF).to(torch.uint8).reshape(n, kw * PACK)   # [N, chunk, j, i] = q[32c + 4j + i]


def dequantize(qweight, scales, zeros, group_size: int, offsets=None) -> torch.Tensor:
    """-> W [N, K] in scales' dtype (without offsets: what the GPU dequant kernel writes, bit for bit; with
    them, what llama.cpp's reference dequantizes, d * q + m, bit for bit in float32)."""
    q = unpack_int4(qweight)
    n, k = q.shape
    if k % group_size == 0:   # whole groups: per-group broadcasts, no [N, K] copies of scales and zeros
        q = q.view(n, k // group_size, group_size)
        s, z = scales[..., None], zeros[..., None]
        o = None if offsets is None else offsets[..., None]
    else:
        s = scales.repeat_interleave(group_size, dim=1)[:, :k]
        z = zeros.repeat_interleave(group_size, dim=1)[:, :k]
        o = None if offsets is None else offsets.repeat_interleave(group_size, dim=1)[:, :k]
    w = (q.to(torch.int16) - z.to(torch.int16)).to(scales.dtype) * s
    if o is not None:
        w += o.to(scales.dtype)
    return w.reshape(n, k)
