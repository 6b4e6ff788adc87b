"""The engine's settings: a module of its own, free of torch, so the command line builds its options from
them without loading the runtime."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 0                 # KV blocks; 0: 512 on the CPU, kv_memory_fraction of free GPU memory
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048      # per-step token budget: bounds a prefill chunk
    prefix_cache: bool = True           # reuse the K/V of full blocks whose token prefix was seen
    max_sessions: int = 64              # chats whose KV is held between requests (session_id)
    kv_memory_fraction: float = 0.85    # of the GPU memory free after weights, when num_blocks is 0
    cuda_graphs: bool = True            # capture decode graphs at start (GPU only)
    overlap: bool = True                # launch step N+1 before reading step N's tokens (same outputs)
    max_waiting: int | None = None      # server: a request that would make more sequences wait is a 429
    # server: the engine steps in a process of its own, the HTTP server in this one, so each has its own GIL
    # and core (engine_process.py); off, in a thread of the server's process
    engine_process: bool = True
    # Prompt plus output tokens a sequence may reach; None: the model's positions, bounded by the KV cache.
    # Lower than the model's, it also narrows the block tables each decode step stages for its CUDA graph
    # (a 128k-position model's are 8,192 entries a row).
    max_context: int | None = None
