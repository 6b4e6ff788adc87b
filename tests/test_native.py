"""engc._native, the cubin launcher: argument packing and error paths on any machine; loading and
launching hand-written PTX kernels (JIT-compiled by the driver) where a GPU is present."""

import struct

import pytest

from engc import _native  # a missing build must fail the suite, not skip it
from engc.cuda import cubin

ON_GPU = _native.available()
gpu = pytest.mark.skipif(not ON_GPU, reason=f"CUDA unavailable: {_native.error()}")
cpu_only = pytest.mark.skipif(ON_GPU, reason="checks behaviour without CUDA")


def test_available_and_error_agree():
    assert isinstance(ON_GPU, bool)
    assert (_native.error() == "") == ON_GPU


@cpu_only
def test_without_cuda_calls_raise_one_clear_line():
    reason = _native.error()
    assert reason and "\n" not in reason
    with pytest.raises(_native.CudaError, match="CUDA is unavailable"):
        _native.load_module(b"\x7fELF....")
    with pytest.raises(_native.CudaError):
        _native.device_count()
    with pytest.raises(_native.CudaError):
        _native.pdl_supported()
    assert issubclass(_native.CudaError, RuntimeError)
    with pytest.raises(cubin.CudaUnavailableError, match="CUDA is unavailable"):
        cubin.require_cuda()
    assert not cubin.cuda_available()


def test_layout_aligns_each_parameter_to_its_size():
    packed = _native.pack_args("ipd", [1, 2, 3.0])
    assert len(packed) == 24
    assert packed == struct.pack("<i4xQd", 1, 2, 3.0)
    # Same order and padding as a C struct: this is also the layout the cubin's parameter bank uses.
    sig = "pcCsSiIlLhBfd"
    values = [0x1234, -2, 250, -300, 60000, -7, 4_000_000_000, -(2**40), 2**64 - 1, 1.5, 1.5, 0.25, -2.5]
    expected = struct.pack("<QbBhH2xiIqQe", *values[:10]) + bytes.fromhex("c03f") + struct.pack("<fd", 0.25, -2.5)
    assert len(expected) == 56
    assert _native.pack_args(sig, values) == expected
    assert len(_native.pack_args("ci", [1, 1])) == 8
    assert len(_native.pack_args("ic", [1, 1])) == 8
    assert _native.pack_args("", []) == b""


def test_float_codes_round_like_the_device():
    assert _native.pack_args("h", [1.0 / 3]) == struct.pack("<e", 1.0 / 3)
    assert _native.pack_args("B", [1.0]) == bytes.fromhex("803f")
    assert _native.pack_args("B", [1.00390625]) == bytes.fromhex("803f")  # tie rounds to even
    assert _native.pack_args("B", [1.01171875]) == bytes.fromhex("823f")  # tie rounds to even (up)
    assert _native.pack_args("f", [3]) == struct.pack("<f", 3.0)


def test_pointer_accepts_int_none_and_data_ptr():
    class FakeTensor:
        def data_ptr(self):
            return 0xDEADBEEF

    packed = _native.pack_args("ppp", [0x1000, None, FakeTensor()])
    assert struct.unpack("<QQQ", packed) == (0x1000, 0, 0xDEADBEEF)


def test_kernel_pointers_take_addresses_once_and_drop_the_rules_scratch_params():
    """Kernel.pointers: a launch rule's args (its two trailing scratch params included) as launch() takes them,
    each tensor read for its address once; no CUDA call, so it runs here."""
    import torch
    x = torch.zeros(4)
    kernel = cubin.Kernel(0, 0, "k", "pif", block_x=128, shared_mem=0, scratch_params=2)
    assert kernel.pointers([x, 7, 0.5, 0, 0]) == [x.data_ptr(), 7, 0.5]


@pytest.mark.parametrize(
    ("signature", "args", "error", "match"),
    [
        ("ii", [1], ValueError, "2 parameters but 1 arguments"),
        ("i", [1, 2], ValueError, "1 parameters but 2 arguments"),
        ("ix", [1, 2], ValueError, "unknown parameter code 'x'"),
        ("i", [2**31], ValueError, "out of range"),
        ("c", [128], ValueError, "out of range"),
        ("I", [-1], ValueError, "out of range"),
        ("p", [-8], ValueError, "out of range"),
        ("L", [2**64], ValueError, "out of range"),
        ("h", [1e6], ValueError, "does not fit in fp16"),
        ("i", [1.5], TypeError, "expects an int"),
        ("f", ["1.0"], TypeError, "expects a float"),
        ("p", [object()], TypeError, "expects an int"),
    ],
)
def test_bad_arguments_raise_instead_of_crashing(signature, args, error, match):
    with pytest.raises(error, match=match):
        _native.pack_args(signature, args)


def test_args_must_be_a_sequence():
    with pytest.raises(TypeError):
        _native.pack_args("i", 5)


def test_unknown_handles_are_rejected():
    with pytest.raises(ValueError, match="unknown function handle"):
        _native.Launch(0x1234, (1, 1, 1), 128, 0, "i", [1])
    with pytest.raises(ValueError, match="grid y"):
        _native.Launch(0x1234, (1, 70000, 1), 128, 0, "i", [1])
    with pytest.raises(ValueError, match="block_x"):
        _native.Launch(0x1234, (1, 1, 1), 2048, 0, "i", [1])
    with pytest.raises(ValueError, match="unknown function handle"):
        _native.set_pdl(0x1234, True)
    with pytest.raises(ValueError, match="unknown function handle"):
        _native.set_shared_carveout(0x1234, 100)
    with pytest.raises(ValueError, match="carveout must be"):
        _native.set_shared_carveout(0x1234, 101)
    with pytest.raises(TypeError, match="Launch"):
        _native.launch_many([1, 2], 0)
    _native.launch_many([], 0)
    assert len(_native.LaunchPlan([])) == 0
    if ON_GPU:
        with pytest.raises(ValueError, match="unknown module handle"):
            _native.get_function(0x1234, "k")


def test_signature_from_triton():
    assert cubin.signature_from_triton(["*fp16", "*bf16", "i32", "fp32", "constexpr", "i64", "u1"]) == "ppiflC"
    with pytest.raises(ValueError, match="tensordesc"):
        cubin.signature_from_triton(["tensordesc<fp16[64, 64]>"])


# --- GPU: hand-written PTX, so no Triton or toolkit is needed; the driver JIT-compiles it. ----------

ECHO_PTX = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry echo_params(.param .u64 out, .param .s8 a_c, .param .u8 a_C, .param .s16 a_s,
    .param .u16 a_S, .param .s32 a_i, .param .u32 a_I, .param .s64 a_l, .param .u64 a_L,
    .param .b16 a_h, .param .b16 a_B, .param .f32 a_f, .param .f64 a_d)
{
    .reg .b16 %h<5>; .reg .b32 %r<3>; .reg .f32 %f<2>; .reg .f64 %fd<2>; .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];  cvta.to.global.u64 %rd1, %rd1;
    ld.param.s8 %h1, [a_c];    st.global.u8 [%rd1+0], %h1;
    ld.param.u8 %h2, [a_C];    st.global.u8 [%rd1+8], %h2;
    ld.param.s16 %h3, [a_s];   st.global.u16 [%rd1+16], %h3;
    ld.param.u16 %h4, [a_S];   st.global.u16 [%rd1+24], %h4;
    ld.param.s32 %r1, [a_i];   st.global.u32 [%rd1+32], %r1;
    ld.param.u32 %r2, [a_I];   st.global.u32 [%rd1+40], %r2;
    ld.param.s64 %rd2, [a_l];  st.global.u64 [%rd1+48], %rd2;
    ld.param.u64 %rd3, [a_L];  st.global.u64 [%rd1+56], %rd3;
    ld.param.b16 %h1, [a_h];   st.global.b16 [%rd1+64], %h1;
    ld.param.b16 %h2, [a_B];   st.global.b16 [%rd1+72], %h2;
    ld.param.f32 %f1, [a_f];   st.global.f32 [%rd1+80], %f1;
    ld.param.f64 %fd1, [a_d];  st.global.f64 [%rd1+88], %fd1;
    ret;
}
"""

AXPY_PTX = """
.version 7.0
.target sm_70
.address_size 64
.visible .entry axpy(.param .u64 x_ptr, .param .u64 y_ptr, .param .u64 out_ptr, .param .u32 n,
    .param .f32 alpha)
{
    .reg .pred %p<2>; .reg .b32 %r<6>; .reg .f32 %f<5>; .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [x_ptr]; ld.param.u64 %rd2, [y_ptr]; ld.param.u64 %rd3, [out_ptr];
    ld.param.u32 %r1, [n]; ld.param.f32 %f1, [alpha];
    mov.u32 %r2, %ctaid.x; mov.u32 %r3, %ntid.x; mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1; cvta.to.global.u64 %rd5, %rd2; cvta.to.global.u64 %rd6, %rd3;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd4, %rd7; ld.global.f32 %f2, [%rd8];
    add.s64 %rd8, %rd5, %rd7; ld.global.f32 %f3, [%rd8];
    fma.rn.f32 %f4, %f2, %f1, %f3;
    add.s64 %rd9, %rd6, %rd7; st.global.f32 [%rd9], %f4;
DONE:
    ret;
}
"""


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    torch.zeros(1, device="cuda")  # torch makes its primary context current first
    return torch


@gpu
def test_every_parameter_code_reaches_the_kernel(torch_cuda):
    torch = torch_cuda
    module = _native.load_module(ECHO_PTX.encode())
    func = _native.get_function(module, "echo_params")
    out = torch.zeros(12, dtype=torch.int64, device="cuda")
    values = [out, -2, 250, -300, 60000, -7, 4_000_000_000, -(2**40), 2**64 - 1, 1.5, -2.0, 0.25, -2.5]
    _native.launch(func, (1, 1, 1), 1, 0, cubin.current_stream(), "pcCsSiIlLhBfd", values)
    raw = out.cpu().numpy().tobytes()
    slot = [raw[i * 8:(i + 1) * 8] for i in range(12)]
    assert struct.unpack("<b", slot[0][:1])[0] == -2
    assert slot[1][0] == 250
    assert struct.unpack("<h", slot[2][:2])[0] == -300
    assert struct.unpack("<H", slot[3][:2])[0] == 60000
    assert struct.unpack("<i", slot[4][:4])[0] == -7
    assert struct.unpack("<I", slot[5][:4])[0] == 4_000_000_000
    assert struct.unpack("<q", slot[6])[0] == -(2**40)
    assert struct.unpack("<Q", slot[7])[0] == 2**64 - 1
    assert struct.unpack("<e", slot[8][:2])[0] == 1.5
    assert slot[9][:2] == bytes.fromhex("00c0")  # bf16 -2.0
    assert struct.unpack("<f", slot[10][:4])[0] == 0.25
    assert struct.unpack("<d", slot[11])[0] == -2.5
    _native.unload_module(module)
    with pytest.raises(ValueError, match="unknown function handle"):
        _native.launch(func, 1, 1, 0, 0, "p", [0])


@gpu
def test_launch_objects_plans_and_graph_replay(torch_cuda):
    torch = torch_cuda
    kernel = cubin.load_kernel(AXPY_PTX.encode(), "axpy", "pppif", block_x=128)
    assert kernel.attributes()["num_regs"] > 0
    n = 1000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda")
    grid = ((n + 127) // 128, 1, 1)
    stream = cubin.current_stream()

    kernel.launch(grid, [x, y, out, n, 2.0], stream)
    torch.testing.assert_close(out, 2.0 * x + y)

    step = kernel.prepare(grid, [x, y, out, n, 3.0])
    step(stream)
    torch.testing.assert_close(out, 3.0 * x + y)
    step.set_arg(4, -1.0)
    _native.launch_many([step], stream)
    torch.testing.assert_close(out, -x + y)
    plan = _native.LaunchPlan([step, step])
    plan(stream)
    torch.testing.assert_close(out, -x + y)

    graph = torch.cuda.CUDAGraph()
    step.set_arg(4, 0.5)
    with torch.cuda.graph(graph):
        _native.launch_many([step], cubin.current_stream())
    x.copy_(torch.randn(n, device="cuda"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 0.5 * x + y)

    _native.unload_module(kernel.module)
    with pytest.raises(ValueError, match="unloaded"):
        step(stream)


@gpu
def test_bad_images_name_the_cuda_error():
    with pytest.raises(_native.CudaError, match="CUDA_ERROR_"):
        _native.load_module(b"\x7fELF not really a cubin")
    with pytest.raises(_native.CudaError, match="CUDA_ERROR_"):
        _native.load_module(b".version 7.0\n.target sm_70\n.address_size 64\n.entry broken( {\n")
    module = _native.load_module(AXPY_PTX.encode())
    with pytest.raises(_native.CudaError, match="CUDA_ERROR_NOT_FOUND"):
        _native.get_function(module, "no_such_kernel")
    _native.unload_module(module)


# 16 KiB of static shared memory plus a dynamic buffer (the CUDA int4 GEMV's shape): the driver's default
# dynamic limit is 48 KiB minus the static 16, so a 36 KiB dynamic launch (52 KiB in all) needs it raised
# although it is below 48 KiB; both loaders must see that (the first H200 run of that GEMV failed here).
STATIC_AND_DYNAMIC_PTX = """
.version 7.0
.target sm_70
.address_size 64
.extern .shared .align 16 .b8 dyn_smem[];
.visible .entry static_and_dynamic(.param .u64 out_ptr, .param .u32 dyn_last)
{
    .shared .align 16 .b8 fixed_smem[16384];
    .reg .b32 %r<8>;
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [out_ptr];
    ld.param.u32 %r1, [dyn_last];
    mov.u32 %r2, dyn_smem;
    add.u32 %r2, %r2, %r1;
    st.shared.u32 [fixed_smem+16380], 7;
    st.shared.u32 [%r2], 35;
    bar.sync 0;
    ld.volatile.shared.u32 %r3, [fixed_smem+16380];
    ld.volatile.shared.u32 %r4, [%r2];
    add.u32 %r5, %r3, %r4;
    st.global.u32 [%rd1], %r5;
    ret;
}
"""


@gpu
def test_static_plus_dynamic_shared_past_48k_launches(torch_cuda):
    torch = torch_cuda
    dynamic = 36 * 1024
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = cubin.current_stream()
    kernel = cubin.load_kernel(STATIC_AND_DYNAMIC_PTX.encode(), "static_and_dynamic", "pI", block_x=32,
                               shared_mem=dynamic)
    attrs = kernel.attributes()
    assert attrs["static_shared_bytes"] >= 16384 and attrs["max_dynamic_shared_bytes"] >= dynamic
    kernel.launch(1, [out, dynamic - 4], stream)
    torch.cuda.synchronize()
    assert out.item() == 42
    # the native launcher alone: get_function starts from the driver's limit, the launch raises it
    module = _native.load_module(STATIC_AND_DYNAMIC_PTX.encode())
    func = _native.get_function(module, "static_and_dynamic")
    out.zero_()
    _native.launch(func, 1, 32, dynamic, stream, "pI", [out.data_ptr(), dynamic - 4])
    torch.cuda.synchronize()
    assert out.item() == 42
    _native.unload_module(module)
