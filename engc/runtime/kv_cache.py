"""Paged KV cache: fixed-size blocks handed out to sequences through block tables, plus a prefix cache.

The allocator only counts blocks; the cache tensors live in KVCache, one per layer, laid out
[2, num_blocks, block_size, num_kv_heads, head_dim] as the attention and rotary ops expect. A quantized
cache (a bundle built with --kv-cache int8|fp8) holds per layer a pair: codes of that layout in int8 or
float8_e4m3fn, and float32 scales [2, num_blocks, block_size, num_kv_heads] (kernels/kv_quant.py).
Multi-head latent attention (DeepSeek) caches one row a token instead: [1, num_blocks, block_size, 1,
kv_lora_rank + qk_rope_head_dim], the normed latent then the rotated rope key (kernels/mla_attention).

Prefix cache: a full block whose K/V are computed is registered under a hash chained over every token
up to its end, so equal hashes mean equal prefixes. A released block keeps its hash and waits in an
LRU list; it is reused on a match, and evicted (oldest first) only when no never-hashed block is left.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque

import torch

from engc.bundle.model_config import ModelConfig
from engc.kernels import kv_quant


def chain_hash(prev: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))   # each a 4-byte little-endian int32
    return h.digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.empty = deque(range(num_blocks))          # free, holding nothing reusable
        self.cached: OrderedDict[int, None] = OrderedDict()  # free but hashed, least recently used first
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.queried_tokens = 0                         # prefix-cache lookups, for the hit rate
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate(self) -> int:
        if self.empty:
            block = self.empty.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_hash[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise RuntimeError("KV cache out of blocks")
        self.ref_count[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        # Later blocks of a chain are worth less (they match only after all earlier ones), so they
        # go first into the LRU order and are evicted first.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    self.empty.append(b)
                else:
                    self.cached[b] = None

    def match(self, token_ids: list[int], hashes: list[bytes]) -> list[int]:
        """Takes a reference on the longest run of cached full blocks that prefix token_ids.

        Fills `hashes` with the chain over the matched blocks. Never matches the last token, whose
        logits the caller still needs.
        """
        bs, blocks = self.block_size, []
        self.queried_tokens += len(token_ids)
        if not self.prefix_cache:
            return blocks
        prev = b""
        for i in range((len(token_ids) - 1) // bs):
            h = chain_hash(prev, token_ids[i * bs:(i + 1) * bs])
            block = self.by_hash.get(h)
            if block is None:
                break
            if self.ref_count[block] == 0:
                del self.cached[block]
            self.ref_count[block] += 1
            blocks.append(block)
            hashes.append(h)
            prev = h
        self.hit_tokens += len(blocks) * bs
        return blocks

    def register(self, tokens: list[int], table: list[int], hashes: list[bytes]) -> None:
        """Hashes the full blocks of `table` that follow the ones in `hashes`; `tokens` are their tokens (whole
        blocks, computed)."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        for at in range(0, len(tokens) - bs + 1, bs):
            h = chain_hash(hashes[-1] if hashes else b"", tokens[at:at + bs])
            block = table[len(hashes)]
            hashes.append(h)
            if h not in self.by_hash and self.block_hash[block] is None:
                self.by_hash[h] = block
                self.block_hash[block] = h

    def check_integrity(self, tables: list[list[int]]) -> None:
        """Every block is free xor referenced exactly as often as the live block tables hold it."""
        held = [0] * self.num_blocks
        for table in tables:
            for b in table:
                held[b] += 1
        free = list(self.empty) + list(self.cached)
        assert len(set(free)) == len(free), "a block is free twice"
        free = set(free)
        for b in range(self.num_blocks):
            assert held[b] == self.ref_count[b], f"block {b}: held {held[b]}, ref_count {self.ref_count[b]}"
            assert (b in free) == (held[b] == 0), f"block {b}: free list disagrees with its ref_count"
            assert (b in self.cached) == (held[b] == 0 and self.block_hash[b] is not None), \
                f"block {b}: LRU list disagrees with its hash"
        assert all(self.block_hash[b] == h for h, b in self.by_hash.items()), "hash index out of date"
        assert sum(h is not None for h in self.block_hash) == len(self.by_hash), "a hash is unindexed"


class KVCache:
    """layers[i] is what the program's kv_cache.{i} input takes: a tensor, or for a quantized cache the
    pair (codes, scales), which the executor binds to kv_cache.{i} and kv_scale.{i}."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", prefix_cache: bool = True):
        planes, rows, width = cfg.kv_cache_row   # latent attention: [1, blocks, block_size, 1, latent + rope]
        shape = (planes, num_blocks, block_size, rows, width)
        if kv_quant.is_quantized(dtype):
            self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape[:-1], dtype=torch.float32, device=device))
                           for _ in range(cfg.num_layers)]
        else:
            self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_cache)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """dtype: the cache's (the model's, or int8/float8_e4m3fn, which add a float32 scale a row)."""
        planes, rows, width = cfg.kv_cache_row
        row = width * torch.empty((), dtype=dtype).element_size()
        if kv_quant.is_quantized(dtype):
            row += 4
        return planes * block_size * rows * row * cfg.num_layers

    @staticmethod
    def default_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                           fraction: float) -> int:
        """512 on the CPU; on a GPU, what `fraction` of its free memory holds."""
        if device.type != "cuda":
            return 512
        free, _ = torch.cuda.mem_get_info(device)
        return max(16, int(free * fraction) // KVCache.bytes_per_block(cfg, block_size, dtype))
