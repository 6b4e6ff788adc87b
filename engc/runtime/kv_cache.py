"""Paged KV cache: fixed-size blocks handed out to sequences through block tables.

The allocator only counts blocks; the cache tensors live in KVCache, one per layer, laid out
[2, num_blocks, block_size, num_kv_heads, head_dim] as the attention and rotary ops expect.
"""
from __future__ import annotations

from collections import deque

import torch

from engc.bundle.model_config import ModelConfig


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache out of blocks")
        block = self.free.popleft()
        self.ref_count[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free.append(b)

    def check_integrity(self, tables: list[list[int]]) -> None:
        """Every block is free xor referenced exactly as often as the live block tables hold it."""
        held = [0] * self.num_blocks
        for table in tables:
            for b in table:
                held[b] += 1
        free = set(self.free)
        assert len(free) == len(self.free), "a block is free twice"
        for b in range(self.num_blocks):
            assert held[b] == self.ref_count[b], f"block {b}: held {held[b]}, ref_count {self.ref_count[b]}"
            assert (b in free) == (held[b] == 0), f"block {b}: free list disagrees with its ref_count"


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.allocator = BlockAllocator(num_blocks, block_size)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem * cfg.num_layers
