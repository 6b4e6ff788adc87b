"""A serving process's heap after start-up: out of the garbage collector's walks."""
from __future__ import annotations

import gc


def settle_heap() -> None:
    """Takes what start-up left alive (the model's modules and tensors, the tokenizer, the app: some 10^5 objects)
    out of the garbage collector's view, and lets it collect the young generation less often. A full collection
    otherwise walks all of it every few hundred requests (0.18 s a time on the SmolLM2 bundle, on this project's
    2-core CPU) with the GIL held: every stream and the engine's next step wait that long. What requests
    allocate is still collected. Both the server's process and the engine's (engine_process.py) settle theirs."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
