"""Greedy decoding's argmax over the vocabulary, split across many programs.

torch.argmax gives one row of a large vocabulary to a single block, which costs more than a layer of a
small model at any batch size (bench/results/HISTORY.md). Here each row is cut into SPLITS chunks; stage 1 finds each
chunk's max and first index (grid (B, SPLITS)), stage 2 picks the winner per row (grid (B,)).

logits [B, V] (fp32, bf16 or fp16) -> out [B] int64, the first index of the maximum (torch's rule on
ties), a NaN counting as +inf (torch counts NaN the maximum; they differ only where a +inf comes before
the first NaN). A row with NaN has no meaningful greedy token, but it gets a valid one: an id outside the
vocabulary would fail the next step's embedding gather on the device and stop the engine.
"""
import torch


def nan_as_max(logits: torch.Tensor) -> torch.Tensor:
    """logits in float32 with every NaN as +inf: the order the argmax and sampling kernels rank by."""
    return torch.nan_to_num(logits.float(), nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(nan_as_max(logits), dim=-1)


def workspace(rows: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk partial results: max value (float32) and its index (int32), [rows * splits] each."""
    return (torch.empty(rows * splits, dtype=torch.float32, device=device),
            torch.empty(rows * splits, dtype=torch.int32, device=device))


_TRITON_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def launch(logits, out, consts, workspace_=None):
    """Launch rule: [(variant, grid, args)] for 'partial_<dtype>' then 'final'.

    logits contiguous [B, V]; out int64 [B]. consts: variant -> record 'launch' ({'SPLITS': n}).
    args of 'partial_*': logits, part_val, part_idx, 0, 0
    args of 'final':     part_val, part_idx, out, 0, 0
    """
    assert logits.is_contiguous() and out.dtype == torch.int64
    rows = logits.shape[0]
    if rows == 0:
        return []
    variant = f"partial_{_TRITON_NAME[logits.dtype]}"
    splits = consts[variant]["SPLITS"]
    val, idx = workspace_ if workspace_ is not None else workspace(rows, splits, logits.device)
    return [(variant, (rows, splits, 1), [logits, val, idx, 0, 0]),
            ("final", (rows, 1, 1), [val, idx, out, 0, 0])]
