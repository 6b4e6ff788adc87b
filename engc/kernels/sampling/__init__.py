"""Sampling of one token per row from logits, with per-row temperature, top-k, top-p and min-p.

ONNX: ai.engc::Sample(logits, temperature, top_k, top_p, uniform, min_p) -> token_ids (int64).
logits [B, V] (any float dtype); temperature, top_p, min_p [B] float32; top_k [B] int32; uniform [B] float32
in [0, 1). The caller draws uniform, so the op is a pure function of its inputs and needs no host sync.

Per row, the filters in the order of Hugging Face transformers' warpers (temperature, top-k, top-p, min-p):
  temperature == 0 -> argmax of the logits (first index on ties; a NaN counts as +inf).
  A row whose largest logit is not finite (NaN, +inf, or all -inf) takes that argmax too, whatever its
  temperature: a valid token id, never one outside the vocabulary.
  s = logits.float() / temperature, mass = exp(s - max s).
  top-k (0 < k < V): keep s >= the k-th largest s (ties at the threshold are kept).
  top-p (p < 1): over the kept tokens in descending s order, find the first token whose cumulative
    mass reaches p * (kept mass); keep s >= its s.
  min-p (min_p > 0): keep tokens whose mass >= min_p, i.e. whose probability is at least min_p times the
    most likely token's (top-k and top-p always keep that token, so the ratio is the same before them).
  Then inverse-CDF sampling in vocabulary order: the first kept token whose cumulative mass exceeds
  uniform * (kept mass).
"""
import torch

from engc.kernels.argmax import nan_as_max


def sample(logits, temperature, top_k, top_p, uniform, min_p=None) -> torch.Tensor:
    """min_p None: 0 for every row (off)."""
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    for i in range(b):
        out[i] = sample_row(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(uniform[i]),
                            0.0 if min_p is None else float(min_p[i]))
    return out


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float,
               min_p: float = 0.0) -> int:
    x = nan_as_max(logits)
    if temperature == 0.0 or not torch.isfinite(x.max()):   # NaN, +inf, or all -inf: nothing to draw from
        return int(torch.argmax(x))
    s = logits.float() / temperature
    v = s.shape[0]
    keep = torch.ones_like(s, dtype=torch.bool)
    if 0 < top_k < v:
        kth = torch.sort(s, descending=True).values[top_k - 1]
        keep = s >= kth
    mass = torch.exp(s - s.max()) * keep
    if top_p < 1.0:
        order = torch.sort(torch.where(keep, s, float("-inf")), descending=True).values
        cum = torch.cumsum(torch.exp(order - s.max()), 0)
        cross = int(torch.searchsorted(cum, top_p * cum[-1]).clamp(max=v - 1))
        keep &= s >= order[cross]
        mass = mass * keep
    if min_p > 0.0:
        keep &= torch.exp(s - s.max()) >= min_p
        mass = mass * keep
    cum = torch.cumsum(mass, 0)
    idx = int(torch.searchsorted(cum, u * cum[-1], right=True))
    last_kept = int(torch.nonzero(keep).max())
    return min(idx, last_kept)


_TRITON_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def row_sizes(consts: dict) -> tuple[int, int]:
    """Entries a row takes in each workspace (kernels/sampling/triton.py reads them at these offsets):
    float32 [slice maxima | slice masses | group maxima | group masses | candidate values | m, Z] and
    int32 [slice argmaxes | slice candidate counts | candidate indices | mode, bound key, top-p flag].
    The finish copies its gathered candidates' keys and masses over the group maxima and masses (read by the
    bound alone) to rank them."""
    s, ng, nc = consts["SPLITS"], consts["NGROUPS"], consts["NCAND"]
    return 2 * s + 2 * ng + nc + 2, 2 * s + nc + 3


def workspace(rows: int, consts: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches' float32 and int32 workspaces for `rows` rows (consts: a variant's record 'launch')."""
    f, i = row_sizes(consts)
    return (torch.empty(rows * f, dtype=torch.float32, device=device),
            torch.empty(rows * i, dtype=torch.int32, device=device))


def candidate_indices(iws: torch.Tensor, rows: int, consts: dict) -> torch.Tensor:
    """The candidate slots' token indices, [rows, SPLITS * CAP_S], slice by slice (what compact wrote)."""
    _, i = row_sizes(consts)
    s = consts["SPLITS"]
    return iws.view(rows, i)[:, 2 * s:2 * s + consts["NCAND"]]


def launch(logits, temperature, top_k, top_p, uniform, min_p, out, consts, workspace_=None):
    """Launch rule: [(variant, grid, args)] for 'stats_<dtype>', 'bound_<dtype>', 'compact_<dtype>' and
    'finish_<dtype>' (fp32, bf16, fp16 logits).

    logits contiguous [B, V]; temperature, top_p, uniform, min_p float32 [B]; top_k int32 [B]; out int64 [B].
    consts: variant -> record 'launch' ({'SPLITS', 'NGROUPS', 'NCAND'}); workspace_: (fws, iws) of at least
    rows * row_sizes entries, else allocated here (on the logits' device, no host sync).
    """
    assert logits.is_contiguous()
    assert (temperature.dtype == top_p.dtype == uniform.dtype == min_p.dtype == torch.float32
            and top_k.dtype == torch.int32)
    assert out.dtype == torch.int64
    rows = logits.shape[0]
    if rows == 0:
        return []
    lt = _TRITON_NAME[logits.dtype]
    c = consts[f"stats_{lt}"]
    fws, iws = workspace_ if workspace_ is not None else workspace(rows, c, logits.device)
    splits = c["SPLITS"]
    return [(f"stats_{lt}", (rows, splits, 1), [logits, temperature, top_k, top_p, min_p, fws, iws, 0, 0]),
            (f"bound_{lt}", (rows, 1, 1), [logits, temperature, top_k, top_p, uniform, min_p, out, fws, iws, 0, 0]),
            (f"compact_{lt}", (rows, splits, 1), [logits, temperature, fws, iws, 0, 0]),
            (f"finish_{lt}", (rows, 1, 1), [logits, temperature, top_k, top_p, uniform, min_p, out, fws, iws,
                                           0, 0])]
