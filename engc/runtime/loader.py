"""Bundle -> a runnable model: verified files, weights on the device, the program bound to ops."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engc.bundle.model_config import ModelConfig
from engc.bundle.program import parse_program
from engc.bundle.reader import Bundle, open_bundle
from engc.errors import BundleError
from engc.runtime.executor import Executor
from engc.runtime.ops_reference import REFERENCE_OPS
from engc.runtime.tokenizer import Tokenizer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    bundle: Bundle
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    executor: Executor
    tokenizer: Tokenizer
    block_size: int


def load(path: Path | str, device: str = "cpu", verify_hashes: bool = True) -> LoadedModel:
    bundle = open_bundle(path, verify_hashes=verify_hashes)
    cfg = bundle.config
    if bundle.dtype not in TORCH_DTYPES:
        raise BundleError(f"{bundle.path}: unsupported dtype '{bundle.dtype}'")
    dev = torch.device(device)
    if dev.type != "cpu":
        raise BundleError(f"device '{device}' is not supported by this runtime yet; use cpu")
    program = parse_program(bundle.read(bundle.manifest["program"]))
    weights = {}
    for rel in bundle.manifest["weights"]:
        weights.update(load_file(str(bundle.file(rel)), device=str(dev)))
    missing = [n for n in program.initializers if n not in weights]
    if missing:
        raise BundleError(f"{bundle.path}: program needs weight '{missing[0]}' missing from the weights")
    executor = Executor(program, weights, REFERENCE_OPS)
    tokenizer = Tokenizer(bundle.file("tokenizer"), cfg.eos_token_ids)
    return LoadedModel(bundle, cfg, TORCH_DTYPES[bundle.dtype], dev, executor, tokenizer,
                       bundle.manifest["kv_block_size"])
