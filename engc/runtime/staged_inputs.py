"""The decode graphs' inputs: where the host writes a step's inputs and where the graph reads them.

Graphs read fixed buffers, so the host writes a step's inputs into one of two pinned staging buffers in turn
(the GPU may still be reading the other one, for the step before). The graph itself copies its turn's buffer
to the device as its first kernel, and writes the step's tokens back into pinned memory as its last: both are
kernels reading and writing pinned host memory over PCIe (mapped_view; unified addressing, every 64-bit CUDA
platform), because a copy-engine memcpy before or after a replay leaves a gap on the GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from engc.runtime.executor import TokenFill

# int64 fields first (two int32 words each), then int32 fields; block_tables last so a step copies
# only the rows it uses, each as wide as its graph's context bucket (a [rows, width] block at the region's
# start). fill_sel: where each row's input id comes from (see StagedInputs.pool).
I64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices", "fill_sel")
I32_FIELDS = ("context_lens", "query_start_loc")
# The sampling kernels' row parameters (kernels/sampling), float32 but top_k (int32), one word a row; a
# greedy row has temperature 0, the value every row is staged with when the engine sends none.
DRAW_FIELDS = ("temperature", "top_k", "top_p", "uniform", "min_p")
TURNS = 2


def _aligned(words: int) -> int:
    """The first int32 offset at or after words that lies on a 16-byte boundary."""
    return -(-words // 4) * 4


_TYPESTR = {torch.int32: "<i4", torch.int64: "<i8"}


class _Mapped:
    """A pinned host tensor as a CUDA array (__cuda_array_interface__): its host address, which the GPU can
    address too (unified addressing maps pinned memory), so torch makes a CUDA tensor over the same bytes."""

    def __init__(self, t: torch.Tensor):
        self.t = t   # kept alive by the CUDA tensor made from this object
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
                                         "data": (t.data_ptr(), False), "version": 2}


def mapped_view(host: torch.Tensor) -> torch.Tensor | None:
    """host (pinned, contiguous) as a CUDA tensor over the same memory, for kernels to read and write over
    PCIe; None where torch or the driver will not make one."""
    try:
        view = torch.as_tensor(_Mapped(host), device="cuda")
    except Exception:   # no unified addressing, or a torch that refuses host memory
        return None
    return view if view.data_ptr() == host.data_ptr() else None


def _kernel_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src with an elementwise kernel: copy_ between two CUDA tensors would be a copy-engine memcpy,
    the hand-off the in-graph staging is there to avoid."""
    torch.bitwise_or(src, 0, out=dst)


class StagedInputs:
    """The decode graphs' input tensors as views of one device buffer, filled by the graph itself from one
    of two pinned host buffers; and where the step's tokens go (`last_tokens` on the device, `tokens` on
    the host, per turn)."""

    def __init__(self, max_batch: int, max_blocks: int, device):
        self.n, self.width = max_batch, max_blocks
        self.offsets, at = {}, 0
        # Every field starts on a 16-byte boundary: the kernels are compiled assuming their pointer
        # arguments are (BundleKernels.run checks it; an odd max_batch + 1 put the tables 8 bytes off).
        for name in I64_FIELDS:
            self.offsets[name] = at = _aligned(at)
            at += 2 * max_batch
        for name in I32_FIELDS:
            self.offsets[name] = at = _aligned(at)
            at += max_batch + 1
        for name in DRAW_FIELDS:
            self.offsets[name] = at = _aligned(at)
            at += max_batch
        self.offsets["block_tables"] = at = _aligned(at)
        self.size = _aligned(at + max_batch * max_blocks)   # whole 16-byte lines: turn 1's row aligned too
        cuda = torch.device(device).type == "cuda"
        stack = torch.zeros(TURNS, self.size, dtype=torch.int32)
        stack = stack.pin_memory() if cuda else stack
        self.host_stack = mapped_view(stack) if cuda else stack   # row t: turn t's inputs, as the graphs read them
        self.turn = 0                                   # which host buffer the next step writes
        # One device buffer: the previous step's tokens (last_tokens), then the staged fields. The int64
        # pool over [last_tokens | input_ids] is what fill_sel indexes: an index below n takes that row of
        # the previous step's tokens, ids_base + i the staged id of row i.
        lead = _aligned(2 * max_batch)
        self.ids_base = lead // 2
        whole = torch.zeros(lead + self.size, dtype=torch.int32, device=device)
        self.device = whole[lead:]
        self.pool = whole[:lead + 2 * max_batch].view(torch.int64)
        self.last_tokens = self.pool[:max_batch]
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=device)    # after the fill
        self.dev = self._views(self.device)
        self.draw_dev = self._draw_views(self.device)
        tokens = torch.zeros(TURNS, max_batch, dtype=torch.int64)
        self.tokens = tokens.pin_memory() if cuda else tokens     # each turn's greedy tokens, for the host
        self.tokens_dev = mapped_view(self.tokens) if cuda else self.tokens
        cpus = [self._views(host) for host in stack]    # where the host writes each turn's inputs
        self.cpu_np = [{name: view.numpy() for name, view in cpu.items()} for cpu in cpus]
        self.draw_np = [{name: view.numpy() for name, view in self._draw_views(host).items()} for host in stack]
        self.tables_np = [self._tables(host).numpy() for host in stack]
        self.own_ids = (self.ids_base + torch.arange(max_batch)).numpy()
        for views in (*cpus, self.dev):
            views["query_start_loc"].copy_(torch.arange(max_batch + 1, dtype=torch.int32))
            views["logits_indices"].copy_(torch.arange(max_batch))
            views["context_lens"].fill_(1)
            views["slot_mapping"].fill_(-1)
            views["fill_sel"].copy_(torch.from_numpy(self.own_ids))

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o, n = self.offsets, self.n
        views = {name: buf[o[name]:o[name] + 2 * n].view(torch.int64) for name in I64_FIELDS}
        views.update({name: buf[o[name]:o[name] + n + 1] for name in I32_FIELDS})
        views["context_lens"] = views["context_lens"][:n]
        return views

    def _tables(self, buf: torch.Tensor) -> torch.Tensor:
        """The block tables' region of buf, flat: a step's rows are its first rows x width words."""
        o = self.offsets["block_tables"]
        return buf[o:o + self.n * self.width]

    def _draw_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o, n = self.offsets, self.n
        return {name: buf[o[name]:o[name] + n] if name == "top_k" else buf[o[name]:o[name] + n].view(torch.float32)
                for name in DRAW_FIELDS}

    def draw_inputs(self, b: int) -> list[torch.Tensor]:
        """The bucket's staged sampling parameters, in the sampling kernels' order."""
        return [self.draw_dev[name][:b] for name in DRAW_FIELDS]

    def used(self, b: int, width: int) -> int:
        """int32 words a bucket of b rows reads: every field, and b rows of block tables width blocks wide."""
        return self.offsets["block_tables"] + b * width

    def bucket_inputs(self, b: int, width: int) -> dict[str, torch.Tensor]:
        views = {name: (t[:b + 1] if name == "query_start_loc" else t[:b]) for name, t in self.dev.items()
                 if name != "fill_sel"}
        views["input_ids"] = self.ids[:b]
        views["block_tables"] = self._tables(self.device)[:b * width].view(b, width)
        return views

    def stage(self, b: int, turn: int, width: int) -> None:
        """Inside the graph: turn's host buffer into the device one, then each row's input id from the
        staged ids or the previous step's tokens."""
        used = self.used(b, width)
        _kernel_copy(self.device[:used], self.host_stack[turn, :used])
        torch.index_select(self.pool, 0, self.dev["fill_sel"][:b], out=self.ids[:b])

    def export(self, b: int, turn: int) -> None:
        """Inside the graph: the step's tokens (last_tokens) into turn's pinned host row."""
        _kernel_copy(self.tokens_dev[turn, :b], self.last_tokens[:b])

    def send(self, inputs: dict[str, torch.Tensor], n: int, b: int, width: int, fill: TokenFill | None,
             draws: np.ndarray | None = None) -> int:
        """Writes a step's inputs into the next host buffer; returns its turn (the graph to replay). width: the
        graph's block-table width, which holds every block of the rows' contexts (blocks past them, reserved
        for tokens to come, are left out: no kernel reads them). draws: the rows' sampling parameters
        (sampler.parameter_block), None for greedy rows."""
        # Written through numpy views of the pinned buffer: a numpy slice assignment costs a fraction
        # of a torch copy_ call, and this runs every decode step.
        turn, cpu = self.turn, self.cpu_np[self.turn]
        self.turn = (self.turn + 1) % TURNS
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            cpu[name][:n] = inputs[name].numpy()
        cpu["input_ids"][n:b] = 0       # padded rows: a valid id (a buffer may hold an in-flight -1)
        cpu["slot_mapping"][n:b] = -1   # no KV write
        cpu["context_lens"][n:b] = 1
        sel = cpu["fill_sel"]
        sel[:b] = self.own_ids[:b]
        if fill is not None:
            sel[fill.rows.numpy()] = fill.src.numpy()
        cols = min(width, inputs["block_tables"].shape[1])
        self.tables_np[turn][:b * width].reshape(b, width)[:n, :cols] = inputs["block_tables"].numpy()[:, :cols]
        draw = self.draw_np[turn]
        if draws is None:
            draw["temperature"][:b] = 0.0
        else:
            for i, name in enumerate(DRAW_FIELDS):
                draw[name][:n] = draws[i, :n].view(np.int32) if name == "top_k" else draws[i, :n]
            draw["temperature"][n:b] = 0.0
        return turn
