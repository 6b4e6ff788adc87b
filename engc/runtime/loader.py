"""Bundle -> a runnable model: verified files, weights on the device, the program bound to ops."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engc.bundle.model_config import ModelConfig
from engc.bundle.program import parse_program
from engc.bundle.reader import Bundle, open_bundle, verify_big_files
from engc.bundle.tp import rank_config, weight_file
from engc.errors import BundleError
from engc.kernels import int4_linear, kv_quant
from engc.runtime.executor import Executor
from engc.runtime.ops_reference import reference_ops
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
    step_facts: object = None   # gpu_ops.StepFacts on a GPU: host-side batch facts kernels read
    sampler: object = None      # sampler.SamplingKernels on a GPU whose bundle has the sampling kernel
    kv_dtype: torch.dtype | None = None   # the KV cache's: dtype, or int8/float8_e4m3fn (--kv-cache)
    tp: object = None           # tp.Group of a tensor-parallel bundle (this process's rank), else None

    @property
    def kv_config(self) -> ModelConfig:
        """The config this process's KV cache and kernels are shaped by: its rank's heads under tensor
        parallelism (bundle/tp.py), else the model's."""
        return rank_config(self.config, self.bundle.manifest.get("tp", 1))


def load(path: Path | str, device: str = "cpu", verify_hashes: bool = True, tp=None) -> LoadedModel:
    """tp: the tp.Group of this process's rank (tp.start makes it); a tensor-parallel bundle needs one."""
    # The weights' digests are checked on other cores while this thread reads them: start-up pays
    # for whichever is slower, not both. Everything else is verified before it is read.
    bundle = open_bundle(path, verify_hashes=verify_hashes, defer_big=True)
    ranks = int(bundle.manifest.get("tp", 1))
    if ranks != (tp.world if tp is not None else 1):
        raise BundleError(f"{bundle.path}: built for {ranks} tensor-parallel ranks: serve it with engc run "
                          f"(which starts them), not in {tp.world if tp is not None else 1} process(es)")
    mine = [weight_file(tp.rank)] if tp is not None else bundle.manifest["weights"]
    pool = ThreadPoolExecutor(1, thread_name_prefix="engc-verify")
    pending = pool.submit(verify_big_files, bundle, mine) if verify_hashes else None
    pool.shutdown(wait=False)
    cfg = bundle.config
    if bundle.dtype not in TORCH_DTYPES:
        raise BundleError(f"{bundle.path}: unsupported dtype '{bundle.dtype}'")
    try:  # a manifest without the field: the cache is in the model dtype
        kv_dtype = kv_quant.cache_dtype(bundle.manifest.get("kv_cache", "auto"), TORCH_DTYPES[bundle.dtype])
    except ValueError as e:
        raise BundleError(f"{bundle.path}: {e}; this engc reads {', '.join(kv_quant.KV_CACHE_CHOICES)}: "
                          "use a matching engc or rebuild the bundle") from None
    layout = (bundle.manifest.get("quantization") or {}).get("layout")
    if layout is not None and layout.startswith("engc-int4") and layout not in int4_linear.LAYOUTS:
        raise BundleError(f"{bundle.path}: its int4 weights are packed as '{layout}'; this engc reads "
                          f"{' or '.join(map(repr, int4_linear.LAYOUTS))}: rebuild the bundle with this engc")
    dev = pick_device(device, bundle)
    program = parse_program(bundle.read(bundle.manifest["program"]))
    weights = {}
    try:
        for rel in mine:   # a rank reads its own file only
            weights.update(read_weights(bundle.file(rel), dev))
    except Exception as e:  # a damaged file: say so in one line, the digest's verdict first
        if pending is not None:
            pending.result()
        raise BundleError(f"{bundle.path}: cannot read the weights ({e.__class__.__name__}: {e})") from None
    if pending is not None:
        pending.result()  # raises the BundleError of a corrupted weight file
    missing = [n for n in program.initializers if n not in weights]
    if missing:
        raise BundleError(f"{bundle.path}: program needs weight '{missing[0]}' missing from the weights")
    facts = sampler = None
    if dev.type == "cuda":
        from engc.kernels.int4_linear import PackedScales
        from engc.kernels.int4_linear.bind import prepack_int4
        from engc.runtime.gpu_ops import BundleKernels, StepFacts, device_arch, gpu_ops
        facts, packed = StepFacts(), PackedScales()
        kernels = BundleKernels(bundle, device_arch(dev))
        executor = Executor(program, weights, gpu_ops(kernels, facts, packed), before_forward=facts.take)
        prepack_int4(program, weights, kernels.consts.get("int4_linear"), packed)   # before the engine sizes the KV cache
        if "sampling" in kernels.consts:
            from engc.runtime.sampler import SamplingKernels
            sampler = SamplingKernels(kernels, dev)
    else:
        executor = Executor(program, weights, reference_ops(TORCH_DTYPES[bundle.dtype]))
    tokenizer = Tokenizer(bundle.file("tokenizer"), cfg.eos_token_ids)
    return LoadedModel(bundle, cfg, TORCH_DTYPES[bundle.dtype], dev, executor, tokenizer,
                       bundle.manifest["kv_block_size"], facts, sampler, kv_dtype, tp)


def pick_device(device: str, bundle: Bundle) -> torch.device:
    """'auto' is the GPU when there is one and the bundle has kernels for it, else the CPU; an explicit
    'cuda' without a GPU is refused (and one the bundle lacks kernels for, by gpu_ops)."""
    if device == "auto":
        device = "cpu"
        if torch.cuda.is_available():
            from engc.runtime.gpu_ops import select_kernels
            major, minor = torch.cuda.get_device_capability()
            try:
                select_kernels(bundle.manifest["kernels"], f"sm{major}{minor}")
                device = "cuda"
            except BundleError:
                pass  # no kernels this GPU can run: serve from the CPU
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BundleError("no CUDA device is available; run with --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise BundleError(f"unsupported device '{device}'; use cpu, cuda or auto")
    return dev


def read_weights(path: Path, device: torch.device, threads: int = 8) -> dict[str, torch.Tensor]:
    """safetensors -> tensors on device. To a GPU, several threads copy at once: one thread's
    pageable host-to-device copies reach about a third of what the link takes."""
    if device.type == "cpu":
        return load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
    groups = [names[i::threads] for i in range(threads)]

    def read(group):
        with safe_open(str(path), framework="pt") as f:
            return {n: f.get_tensor(n).to(device) for n in group}

    weights = {}
    with ThreadPoolExecutor(threads, thread_name_prefix="engc-load") as pool:
        for part in pool.map(read, groups):
            weights.update(part)
    return weights
