"""The sampling kernel under TRITON_INTERPRET=1 against its torch reference (kernels/sampling.sample_row).

Every draw must be the reference's token for the same uniform. A difference is accepted only where it is a
float summation-order tie: the reference gives the kernel's token for the uniform, top_p or min_p nudged by
1e-5 relative. Small tiles keep the interpreter fast and put each path in reach: the candidate path
(top-k, top-p without top-k, min-p) with its small and full gathers, its overflow into the streaming radix
fallback, the temperature-only draw, greedy and non-finite rows, with the row in several slices and in one. The passes over the row are counted from the
interpreter's loads, so the read budget of each case is tested too.

The small gather's thresholds come from pairwise ranks (the tune entry's `pairwise`), the full gather's from
radix selects; both must give the same keys, so the same tokens for the same uniforms: the pairwise_* cases
draw with pairwise ranks and without (pairwise 0: selects only) and want every token and threshold equal,
through the four launches and through the finish alone over candidate sets made to order.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from interpreted import interpreted_report, print_report

ROOT = Path(__file__).resolve().parents[1]
CASES = ["rows_fp32", "rows_bf16", "rows_wide_groups_fp32", "rows_radix4_fp32", "rows_one_slice_bf16",
         "distribution_fp32", "distribution_bf16", "passes", "pairwise_rows_fp32", "pairwise_rows_bf16",
         "pairwise_finish", "pairwise_finish_radix4"]


@pytest.fixture(scope="module")
def report():
    return interpreted_report(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_sampling_kernel_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_the_kernels_compile_at_a_large_vocabulary(arch):
    """The tune table's tiles at a 128k vocabulary compile for each arch (no GPU needed): 32 slices, the small
    and the full gather of the finish both present (the interpreter runs the tiny tiles, not these)."""
    import torch
    from engc.compiler.codegen.aot import compile_spec
    from engc.compiler.codegen.specs import model_specs
    from test_kernels import _cfg
    specs = {s.variant: s for s in model_specs(_cfg(vocab_size=128256), torch.bfloat16, arch, 16)
             if s.op == "sampling"}
    assert set(specs) == {f"{st}_{lt}" for st in ("stats", "bound", "compact", "finish") for lt in ("bf16", "fp32")}
    finish = specs["finish_bf16"].constexprs
    assert finish["SPLITS"] > 1 and finish["NCAND"] > finish["SMALL"] > 0
    for spec in specs.values():
        cubin, _ptx, _meta = compile_spec(spec)
        assert len(cubin) > 0, spec.variant


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_the_compiled_kernel_draws_the_references_tokens_on_a_gpu():
    """The tune table's tiles at a 128k vocabulary, compiled for the GPU: rows of every kind (candidates,
    their overflow, temperature only), each the reference's token up to summation-order ties."""
    import torch
    from engc.kernels import sampling as op
    from test_kernels import _cfg, _specs as model_specs
    vocab = 128256
    specs = model_specs(_cfg(vocab_size=vocab), torch.bfloat16)["sampling"]
    gen = torch.Generator().manual_seed(0)
    kinds = [(0.8, 50, 0.95, 0.0), (0.8, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.05),
             (0.8, 40, 0.9, 0.02), (0.0, 0, 1.0, 0.0), (1.0, 3000, 1.0, 0.0), (0.6, 0, 0.5, 0.0)]
    rows = kinds * 8
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = torch.stack([(15 - (0.7 + 0.1 * (i % 9)) * torch.log(rank) + torch.randn(vocab, generator=gen))
                          [torch.randperm(vocab, generator=gen)] for i in range(len(rows))]).to(torch.bfloat16)
    uniform = torch.rand(len(rows), generator=gen)
    params = [torch.tensor([r[i] for r in rows], dtype=torch.float32) for i in range(4)]
    cuda = [t.cuda() for t in (logits, params[0], params[1].to(torch.int32), params[2], uniform, params[3])]
    out = torch.full((len(rows),), -1, dtype=torch.int64, device="cuda")
    for variant, grid, args in op.launch(*cuda, out, {v: s.launch for v, s in specs.items()}):
        specs[variant].fn()[grid](*args[:-2], **specs[variant].constexprs, num_warps=specs[variant].num_warps)
    bad, _ties = _unexplained(logits, rows, uniform, out.cpu())
    assert not bad, bad[:3]


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

V = 3000
# 8 slices of 375 tokens (two 256-lane blocks each), 32 lane groups and 32 candidate slots a slice
SMALL_TILES = {"block": 256, "max_splits": 8, "groups": 32, "cap_s": 32, "small": 64}


def _specs(overrides=None):
    import torch
    from test_kernels import _cfg, _specs as model_specs
    return model_specs(_cfg(vocab_size=V), torch.bfloat16, overrides={"sampling": overrides or SMALL_TILES})["sampling"]


def _launch(specs, logits, rows, uniform, paths=None):
    """The kernel's tokens and candidate indices (a workspace prefilled with -1) for rows of
    (temperature, top_k, top_p, min_p); paths: a list extended with each row's way through the finish."""
    import torch
    from engc.kernels import sampling as op
    from test_kernels import _run
    consts = {v: s.launch for v, s in specs.items()}
    c = next(iter(consts.values()))
    b = len(rows)
    params = [torch.tensor([r[i] for r in rows], dtype=torch.float32) for i in range(4)]
    top_k = params[1].to(torch.int32)
    out = torch.full((b,), -1, dtype=torch.int64)
    f, i = op.row_sizes(c)
    ws = (torch.full((b * f,), float("nan")), torch.full((b * i,), -1, dtype=torch.int32))
    _run(specs, op.launch(logits, params[0], top_k, params[2], uniform, params[3], out, consts, ws))
    if paths is not None:
        paths += _paths(ws[1], b, specs)
    return out, op.candidate_indices(ws[1], b, c)


def _paths(iws, rows, specs):
    """Each row's way through the finish, from the int32 workspace: 'done' (drawn by the bound), 'small' or
    'all' (the candidates gathered, SMALL of them or every slot), 'stream' (a slice overflowed, or k above the
    groups; a candidate row whose top-p threshold the bound missed streams too, and reads 'small' or 'all')."""
    from engc.kernels import sampling as op
    c = specs["finish_fp32"].constexprs
    _, width = op.row_sizes(c)
    s, ncand = c["SPLITS"], c["NCAND"]
    out = []
    for r in iws.view(rows, width):
        mode, counts = int(r[2 * s + ncand]), r[s:2 * s]
        if mode != 1:
            out.append("done" if mode == 0 else "stream")
        elif int(counts.max()) > c["CAP_S"]:
            out.append("stream")
        else:
            out.append("small" if int(counts.sum()) <= c["SMALL"] else "all")
    return out


def _unexplained(logits, rows, uniform, got):
    """Rows whose token is neither the reference's nor a summation-order tie's; and how many were ties."""
    from engc.kernels.sampling import sample_row
    bad, ties = [], 0
    for i, (t, k, p, mp) in enumerate(rows):
        u = float(uniform[i])
        if sample_row(logits[i], t, k, p, u, mp) == int(got[i]):
            continue
        nudged = [(u * f, p, mp) for f in (1 - 1e-5, 1 + 1e-5)] + [(u, min(1.0, p * f), mp * f)
                                                                   for f in (1 - 1e-5, 1 + 1e-5)]
        if any(sample_row(logits[i], t, k, pp, uu, mm) == int(got[i]) for uu, pp, mm in nudged):
            ties += 1
        else:
            bad.append((i, rows[i], u, int(got[i]), sample_row(logits[i], t, k, p, u, mp)))
    return bad, ties


def _rows_and_logits(dtype, groups):
    """check_rows' rows (temperature, top_k, top_p, min_p) and logits: every path, ties, non-finite rows."""
    import torch
    gen = torch.Generator().manual_seed(7)
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 50, 0.95, 0.0), (0.7, 50, 1.0, 0.0),
            (1.3, 0, 0.9, 0.0), (0.8, 20, 0.5, 0.0), (1.0, 1, 1.0, 0.0), (2.0, V - 1, 0.99, 0.0),
            (0.5, V, 0.3, 0.0), (0.0, 5, 0.5, 0.1), (1.0, 0, 1.0, 0.05), (0.8, 40, 0.95, 0.1),
            (1.0, 0, 0.9, 0.02), (1.0, 0, 0.95, 0.3), (1.0, 0, 0.0, 0.0), (1.0, 0, 1.0, 1.0),
            (1.0, 30, 1.0, 0.0),         # 16: k lands inside a plateau of 40 ties: all of them kept
            (1.0, 0, 0.5, 0.0),          # 17: the top-p crossing inside the top plateau of 20 ties
            (1.0, 50, 0.9, 0.0),         # 18: flat row: more than CAP candidates, the radix fallback
            (1.0, 0, 0.9, 0.0),          # 19: flat row, top-p without top-k: the fallback too
            (0.9, groups + 1, 0.95, 0.0),    # k above the group count: the fallback
            (0.9, 0, 1.0, 0.0), (1.2, 10, 0.8, 0.0), (0.7, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0)]
    b = len(rows)
    logits = (torch.randn(b, V, generator=gen) * 3).to(dtype)
    logits[16, 100:140] = 9.0
    logits[17, 500:520] = 12.0
    logits[18, :] = 1.0
    logits[19, :] = 0.25
    # no distribution to draw from: the row's argmax (a NaN counting as +inf), a valid id, never -1 or 2^31 - 1
    logits[-4, 1234] = float("nan")
    logits[-3, :] = float("-inf")
    logits[-2, 77] = float("inf")
    logits[-1, :] = float("nan")
    return rows, logits, gen


def check_rows(dtype, overrides=None):
    import torch
    specs = _specs(overrides)
    rows, logits, gen = _rows_and_logits(dtype, next(iter(specs.values())).launch["NGROUPS"])
    b = len(rows)
    bad, ties = [], 0
    for trial in range(2):
        uniform = torch.rand(b, generator=gen)
        out, cand = _launch(specs, logits, rows, uniform)
        assert out[-4:].tolist() == [1234, 0, 77, 0], out[-4:]
        for i in (2, 3, 10, 11, 12, 13, 16, 17):    # the candidate path: the row's top tokens, in index order
            written = cand[i][cand[i] >= 0]
            assert 0 < len(written) < cand.shape[1] and bool((written[1:] > written[:-1]).all()), (i, written)
            top = torch.topk(logits[i].float(), rows[i][1] or 1).indices
            assert set(top.tolist()) <= set(written.tolist()), i
        assert bool((cand[18] >= 0).all()) and bool((cand[19] >= 0).all())   # overflowed: every slot taken
        assert bool((cand[0] < 0).all()) and bool((cand[1] < 0).all())       # greedy, temperature only: none
        b_, t_ = _unexplained(logits, rows, uniform, out)
        bad += b_
        ties += t_
    return (len(bad), bad[:3]) if bad else (0, {"ties": ties})


def _model_like(gen, rows: int, tied: bool = False):
    """Logits as a model's (a normal floor, 40 plausible tokens well above it): a top-k, top-p or min-p set
    of a few dozen tokens, the small gather's size; tied: those 40 on 4 levels, so a threshold lands in ties."""
    import torch
    x = torch.randn(rows, V, generator=gen) * 2.0
    top = torch.stack([torch.randperm(V, generator=gen)[:40] for _ in range(rows)])
    high = 12.0 + 3.0 * torch.rand(rows, 40, generator=gen)
    x.scatter_(1, top, high.round() if tied else high)
    return x


def check_pairwise_rows(dtype):
    """The four launches with the small gather's thresholds from ranks and from selects (pairwise 0), on the
    same rows and uniforms: the same token in every row, the reference's (up to summation-order ties).
    Rows of every path: check_rows' (the full gather, the fallback, greedy, non-finite) and model-like rows
    whose candidates fit the small gather, each filter alone and together, thresholds in ties."""
    import torch
    tiles = {**SMALL_TILES, "small": 32}      # 32 gathered first: some of check_rows' rows need every slot
    ranked_specs = _specs({**tiles, "pairwise": 8})
    selects_specs = _specs({**tiles, "pairwise": 0})
    assert ranked_specs["finish_fp32"].constexprs["PAIRWISE"] == 8
    assert selects_specs["finish_fp32"].constexprs["PAIRWISE"] == 0
    rows, logits, gen = _rows_and_logits(dtype, ranked_specs["finish_fp32"].launch["NGROUPS"])
    kinds = [(0.8, 20, 0.95, 0.0), (0.8, 25, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1),
             (1.0, 10, 0.8, 0.02), (0.7, 0, 0.5, 0.0), (0.8, 0, 0.95, 0.1), (1.0, 3, 1.0, 0.0)]
    tied = [(1.0, 15, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.0, 12, 0.7, 0.0), (1.0, 0, 1.0, 0.3)]
    rows = rows + kinds + tied
    logits = torch.cat([logits, _model_like(gen, len(kinds)).to(dtype),
                        _model_like(gen, len(tied), tied=True).to(dtype)])
    b = len(rows)
    bad, ties, paths = [], 0, []
    for trial in range(2):
        uniform = torch.rand(b, generator=gen)
        ranked, _ = _launch(ranked_specs, logits, rows, uniform, paths)
        selected, _ = _launch(selects_specs, logits, rows, uniform)
        differ = [(i, rows[i], int(ranked[i]), int(selected[i])) for i in range(b) if ranked[i] != selected[i]]
        assert not differ, differ[:3]
        b_, t_ = _unexplained(logits, rows, uniform, ranked)
        bad += b_
        ties += t_
    small = {rows[i % b] for i, p in enumerate(paths) if p == "small"}
    assert set(kinds + tied) <= small, sorted(set(kinds + tied) - small)   # each of these took the ranks
    assert {"all", "stream", "done"} <= set(paths), set(paths)
    seen = {p: paths.count(p) for p in sorted(set(paths))}
    return (len(bad), bad[:3]) if bad else (0, {"ties": ties, "paths": seen})


def check_pairwise_finish(radix):
    """The finish alone (a probe kernel around triton._gather and _finish) over candidate sets made to
    order: one candidate, a few, exactly the gather's N, ties (all equal, a few levels), k above the count,
    each filter alone and together. Thresholds from ranks (1, 3 and 8 candidates a step) and from selects:
    the same token and threshold key in every row, the reference's token (up to summation-order ties), and
    every top-p key from ranks confirmed by the selects' sums (ranked: no select ran)."""
    import torch
    gen = torch.Generator().manual_seed(3)
    splits, cap, n, chunk = 4, 32, 64, 500
    vocab = splits * chunk
    sets = []        # (per-slice counts, values kind)
    for counts in ([1, 0, 0, 0], [0, 0, 2, 0], [2, 1, 1, 1], [5, 9, 0, 3], [12, 11, 10, 7], [16, 16, 16, 16],
                   [32, 32, 0, 0], [0, 31, 1, 32]):
        for kind in ("normal", "levels", "equal"):
            sets.append((counts, kind))
    filters = lambda c: [(5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (10, 0.8, 0.05), (c + 3, 0.9, 0.0),
                         (c, 0.5, 0.0), (1, 1.0, 0.0), (0, 0.0, 0.0), (3, 0.3, 0.0), (c - 1 or 1, 0.99, 0.2)]
    logits, rows, slots = [], [], []
    for counts, kind in sets:
        total = sum(counts)
        idx = torch.cat([s * chunk + torch.randperm(chunk, generator=gen)[:c].sort().values
                         for s, c in enumerate(counts)])
        val = {"normal": torch.randn(total, generator=gen) * 2,
               "levels": torch.randint(0, 4, (total,), generator=gen).float() / 2,
               "equal": torch.full((total,), 1.5)}[kind]
        row = torch.full((vocab,), float("-inf"))
        row[idx] = val
        for k, p, mp in filters(total):
            logits.append(row)
            rows.append((1.0, k, p, mp))
            slots.append((counts, idx, val))
    b = len(rows)
    vals = torch.full((b, splits * cap), float("nan"))
    idxs = torch.full((b, splits * cap), -1, dtype=torch.int32)
    counts_t = torch.zeros(b, splits, dtype=torch.int32)
    for r, (counts, idx, val) in enumerate(slots):
        at = 0
        for s, c in enumerate(counts):
            vals[r, s * cap:s * cap + c] = val[at:at + c]
            idxs[r, s * cap:s * cap + c] = idx[at:at + c].to(torch.int32)
            counts_t[r, s] = c
            at += c
    logits = torch.stack(logits)
    m = logits.max(1).values
    z = torch.exp(logits - m[:, None]).sum(1)
    k = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    top_p, min_p = (torch.tensor([r[i] for r in rows], dtype=torch.float32) for i in (2, 3))
    bad, ties, unconfirmed = [], 0, []
    for trial in range(2):
        uniform = torch.rand(b, generator=gen)
        got = {}
        for pairwise in (0, 1, 3, 8):
            out = torch.zeros(b, 3, dtype=torch.int64)
            finish_probe[(b,)](vals, idxs, counts_t, m, z, k, top_p, min_p, uniform,
                               torch.full((b, 2 * n), float("nan")), out, VOCAB=vocab, SPLITS=splits, CAP_S=cap,
                               N=n, RADIX=radix, PAIRWISE=pairwise)
            got[pairwise] = out
        for pairwise in (1, 3, 8):
            differ = (got[pairwise][:, :2] != got[0][:, :2]).any(1).nonzero().flatten().tolist()
            assert not differ, [(i, rows[i], got[pairwise][i].tolist(), got[0][i].tolist()) for i in differ[:3]]
            unconfirmed += [(pairwise, i, rows[i]) for i in range(b)
                            if 0.0 < rows[i][2] < 1.0 and int(got[pairwise][i, 2]) != 1]
        b_, t_ = _unexplained(logits, rows, uniform, got[8][:, 0])
        bad += b_
        ties += t_
    assert not unconfirmed, unconfirmed[:3]
    return (len(bad), bad[:3]) if bad else (0, {"rows": b, "ties": ties})


if os.environ.get("TRITON_INTERPRET") == "1":     # the child: the probe kernel for check_pairwise_finish
    import triton
    import triton.language as tl

    from engc.kernels.sampling import triton as sampling_kernels

    @triton.jit
    def finish_probe(val_ptr, idx_ptr, counts_ptr, m_ptr, z_ptr, k_ptr, top_p_ptr, min_p_ptr, uniform_ptr,
                     scratch_ptr, out_ptr, VOCAB: tl.constexpr, SPLITS: tl.constexpr, CAP_S: tl.constexpr,
                     N: tl.constexpr, RADIX: tl.constexpr, PAIRWISE: tl.constexpr):
        """A row's finish (a program a row) from its candidate slots: token, threshold key, ranked."""
        row = tl.program_id(0)
        counts = tl.load(counts_ptr + row * SPLITS + tl.arange(0, SPLITS))
        total = tl.sum(counts, axis=0)
        cs, ci, valid = sampling_kernels._gather(val_ptr + row * SPLITS * CAP_S, idx_ptr + row * SPLITS * CAP_S,
                                                 counts, total, VOCAB, SPLITS, CAP_S, N)
        k = tl.load(k_ptr + row)
        chosen, floor_key, ranked = sampling_kernels._finish(
            cs, ci, valid, total, tl.load(m_ptr + row), k, (k > 0) & (k < VOCAB), tl.load(top_p_ptr + row),
            tl.load(min_p_ptr + row), tl.load(z_ptr + row), total < 0, tl.load(uniform_ptr + row),
            scratch_ptr + row * 2 * N, scratch_ptr + row * 2 * N + N, VOCAB, RADIX, PAIRWISE)
        tl.store(out_ptr + row * 3, chosen.to(tl.int64))
        tl.store(out_ptr + row * 3 + 1, floor_key)
        tl.store(out_ptr + row * 3 + 2, ranked.to(tl.int64))


def check_distribution(dtype):
    """Many uniforms over one row each (the draw's whole CDF): the reference's token for every one."""
    import torch
    specs = _specs()
    gen = torch.Generator().manual_seed(11)
    kinds = [(0.8, 50, 0.95, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (1.1, 30, 0.9, 0.02),
             (1.5, 0, 1.0, 0.0)]
    n = 16
    rows = [k for k in kinds for _ in range(n)]
    base = torch.randn(len(kinds), V, generator=gen) * 2.5
    logits = base.repeat_interleave(n, 0).to(dtype)
    uniform = ((torch.arange(n) + torch.rand(n, generator=gen)) / n).repeat(len(kinds))
    out, _ = _launch(specs, logits, rows, uniform)
    bad, ties = _unexplained(logits, rows, uniform, out)
    distinct = [len(set(out[j * n:(j + 1) * n].tolist())) for j in range(len(kinds))]
    assert min(distinct) > 1, distinct       # the uniforms do reach different tokens
    return (len(bad), bad[:3]) if bad else (0, {"ties": ties, "distinct tokens": distinct})


def check_passes():
    """How many times each kind of row reads its logits (counted from the interpreter's loads)."""
    import numpy as np
    import torch
    from triton.runtime import interpreter as interp
    specs = _specs()
    window, loaded = [0, 0], [0]
    original = interp.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, *args):
        p = ptrs.data.astype(np.uint64)
        loaded[0] += int(((p >= window[0]) & (p < window[1]) & mask.data).sum())
        return original(self, ptrs, mask, other, *args)

    interp.InterpreterBuilder.create_masked_load = counting
    gen = torch.Generator().manual_seed(5)
    budget = {"greedy": ((0.0, 50, 0.9, 0.0), 1.0), "temperature only": ((1.0, 0, 1.0, 0.0), 2.2),
              "top-k 50, top-p 0.95": ((0.8, 50, 0.95, 0.0), 2.0), "top-p 0.9": ((0.8, 0, 0.9, 0.0), 2.0),
              "min-p 0.05": ((1.0, 0, 1.0, 0.05), 2.0), "all four": ((0.8, 40, 0.9, 0.05), 2.0),
              "flat, top-k 50 (fallback)": ((1.0, 50, 0.9, 0.0), 40.0)}
    seen, over = {}, []
    try:
        for name, (row, most) in budget.items():
            logits = torch.randn(1, V, generator=gen) * 3
            if "flat" in name:
                logits[:] = 1.0
            window[:] = [logits.data_ptr(), logits.data_ptr() + logits.numel() * logits.element_size()]
            loaded[0] = 0
            _launch(specs, logits, [row], torch.rand(1, generator=gen))
            seen[name] = round(loaded[0] / V, 2)
            if seen[name] > most:
                over.append(name)
    finally:
        interp.InterpreterBuilder.create_masked_load = original
    assert seen["flat, top-k 50 (fallback)"] > 30, seen     # the count does see the radix passes
    return len(over), seen


def main():
    import torch
    f32, bf16 = torch.float32, torch.bfloat16
    print_report({
        "rows_fp32": (lambda: check_rows(f32), 0),
        "rows_bf16": (lambda: check_rows(bf16), 0),
        # bounds from whole lanes (as many groups as lanes), 2 candidates gathered at first, so the full
        # gather of every slice's slots serves most rows
        "rows_wide_groups_fp32": (lambda: check_rows(f32, {"block": 256, "max_splits": 4, "groups": 256,
                                                           "cap_s": 128, "small": 2}), 0),
        # thresholds selected 4 bits a step (the table's choice is measured, both must be exact)
        "rows_radix4_fp32": (lambda: check_rows(f32, {**SMALL_TILES, "radix": 4}), 0),
        # the row in one slice (the bound's draw and the finish's gather over one)
        "rows_one_slice_bf16": (lambda: check_rows(bf16, {"block": 512, "max_splits": 1, "groups": 64,
                                                          "cap_s": 256, "small": 64}), 0),
        "distribution_fp32": (lambda: check_distribution(f32), 0),
        "distribution_bf16": (lambda: check_distribution(bf16), 0),
        "passes": (check_passes, 0),
        "pairwise_rows_fp32": (lambda: check_pairwise_rows(f32), 0),
        "pairwise_rows_bf16": (lambda: check_pairwise_rows(bf16), 0),
        "pairwise_finish": (lambda: check_pairwise_finish(2), 0),
        "pairwise_finish_radix4": (lambda: check_pairwise_finish(4), 0),
    })


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
