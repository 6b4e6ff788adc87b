"""Bundle kernels (cubins) for the runtime: a friendly face over engc._native, the C++ launcher.

engc._native loads the CUDA driver (libcuda.so.1) at run time, so it imports on machines with no GPU
and reports CUDA unavailable there; this module turns a missing build or a missing driver into one
clear line (a UserError), and keeps Triton's calling convention in one place.

    kernel = load_kernel(cubin, "rms_norm_kernel", "pppif", block_x=128, scratch_params=2)
    kernel.launch((n_rows, 1, 1), [x, w, out, n_cols, eps], current_stream())
    step = kernel.prepare((n_rows, 1, 1), [x, w, out, n_cols, eps])   # a native Launch: step(stream)

Signature codes (one per kernel parameter): p pointer, c/C int8/uint8, s/S int16/uint16, i/I int32/uint32,
l/L int64/uint64, h fp16, B bf16, f fp32, d fp64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engc.errors import UserError

try:
    from engc import _native
except ImportError as exc:  # the C++ extension was not built in this checkout
    _native = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

# Triton's scalar type names -> signature codes. A pointer ("*fp16", ...) is 'p'; constexprs are not
# kernel parameters.
TRITON_TYPE_CODES = {
    "i1": "c", "i8": "c", "i16": "s", "i32": "i", "i64": "l",
    "u1": "C", "u8": "C", "u16": "S", "u32": "I", "u64": "L",
    "fp16": "h", "bf16": "B", "fp32": "f", "f32": "f", "fp64": "d",
}
# Bytes the native launcher packs for each signature code (native/args.cpp, param_size).
PARAM_BYTES = {"c": 1, "C": 1, "s": 2, "S": 2, "h": 2, "B": 2, "i": 4, "I": 4, "f": 4, "l": 8, "L": 8, "d": 8, "p": 8}
# Triton (3.5 and later) appends two pointer parameters, global and profile scratch, to every kernel.
TRITON_SCRATCH_PARAMS = 2


class CudaUnavailableError(UserError):
    """GPU kernels were asked for where the CUDA driver or a device is missing."""


def native():
    """The engc._native module, or a UserError saying how to build it."""
    if _native is None:
        raise UserError(
            f"the engc._native extension is not built ({_IMPORT_ERROR}); "
            "run `pip install --no-build-isolation -e .` in the engc checkout"
        )
    return _native


def cuda_available() -> bool:
    return _native is not None and _native.available()


def cuda_unavailable_reason() -> str:
    """Why cuda_available() is False ('' when it is True)."""
    if _native is None:
        return f"the engc._native extension is not built ({_IMPORT_ERROR})"
    return _native.error()


def require_cuda():
    """engc._native, when it can launch kernels; CudaUnavailableError otherwise."""
    if not cuda_available():
        raise CudaUnavailableError(f"CUDA is unavailable: {cuda_unavailable_reason()}")
    return _native


def signature_from_triton(types: Sequence[str]) -> str:
    """Signature codes for a Triton kernel's parameter types (constexprs skipped, scratch not included)."""
    codes = []
    for ty in types:
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            codes.append("p")
        elif ty in TRITON_TYPE_CODES:
            codes.append(TRITON_TYPE_CODES[ty])
        else:
            raise ValueError(f"Triton parameter type {ty!r} has no launcher signature code")
    return "".join(codes)


def current_stream() -> int:
    """torch's current CUDA stream as the int handle launches take (the capturing stream inside a graph)."""
    import torch

    return torch.cuda.current_stream().cuda_stream


class Kernel:
    """One kernel function of a loaded module, with the launch constants it was compiled for."""

    __slots__ = ("name", "module", "func", "signature", "block_x", "shared_mem", "_trailing", "_full_signature")

    def __init__(self, module: int, func: int, name: str, signature: str, block_x: int, shared_mem: int,
                 scratch_params: int):
        self.name = name
        self.module = module
        self.func = func
        self.signature = signature
        self.block_x = block_x
        self.shared_mem = shared_mem
        # Triton's scratch buffers are unused by kernels whose global/profile scratch sizes are 0: null.
        self._trailing = (0,) * scratch_params
        self._full_signature = signature + "p" * scratch_params

    def launch(self, grid: Sequence[int] | int, args: Sequence[Any], stream: int) -> None:
        _native.launch(self.func, grid, self.block_x, self.shared_mem, stream, self._full_signature,
                       (*args, *self._trailing))

    def pointers(self, args: Sequence[Any]) -> list:
        """A launch rule's args for this kernel with each tensor's address taken once (launch() reads a tensor's
        data_ptr() on every call, which a timing loop should not pay); the rule's trailing scratch params, which
        launch() appends itself, dropped."""
        return [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args[:len(self.signature)]]

    def prepare(self, grid: Sequence[int] | int, args: Sequence[Any]):
        """A native Launch, packed once: call it with a stream; set_arg(i, v) to change argument i."""
        return _native.Launch(self.func, grid, self.block_x, self.shared_mem, self._full_signature,
                              (*args, *self._trailing))

    def attributes(self) -> dict[str, int]:
        return _native.function_attributes(self.func)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, signature={self.signature!r}, block_x={self.block_x})"


def load_kernel(image: bytes, name: str, signature: str, *, block_x: int, shared_mem: int = 0,
                scratch_params: int = 0, device: int = -1, pdl: bool = False, carveout: int | None = None) -> Kernel:
    """Load a cubin (or PTX) image and look up its kernel `name`.

    pdl: launch it with programmatic dependent launch (it may start before the previous kernel in the
    stream ends; it must wait with griddepcontrol.wait before touching data that kernel uses), where the
    driver supports it; elsewhere it launches normally, and its wait is a no-op.
    carveout: its preferred shared-memory share of L1 in percent (None: the driver's choice).

    `signature` covers the kernel's own parameters; `scratch_params` null pointers are appended to every
    launch (TRITON_SCRATCH_PARAMS for Triton kernels). The module lives in the current CUDA context, or
    in the primary context of `device` (torch's) when none is current.
    """
    lib = require_cuda()
    module = lib.load_module(image, device)
    try:
        func = lib.get_function(module, name)
        # The driver lets a launch have at most 48 KiB minus the kernel's static shared memory of dynamic
        # shared memory until the limit is raised: a CUDA C++ kernel with both kinds needs it raised below
        # 48 KiB of dynamic (a Triton kernel has no static shared memory, so there it is 48 KiB).
        if shared_mem > 0 and shared_mem > lib.function_attributes(func)["max_dynamic_shared_bytes"]:
            lib.set_max_dynamic_shared(func, shared_mem)
        if pdl and lib.pdl_supported():
            lib.set_pdl(func, True)
        if carveout is not None:
            lib.set_shared_carveout(func, carveout)
    except Exception:
        lib.unload_module(module)
        raise
    return Kernel(module, func, name, signature, block_x, shared_mem, scratch_params)


def launch_many(launches: Sequence[Any], stream: int) -> None:
    """Fire prepared launches in order on `stream` in one call into C++ (see engc._native.LaunchPlan)."""
    _native.launch_many(launches, stream)
