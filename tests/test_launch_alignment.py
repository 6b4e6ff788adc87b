"""runtime/gpu_ops.BundleKernels.run refuses a pointer argument the kernel would misread: every kernel is
compiled assuming 16-byte-aligned pointers (the record's 'align'), so a view at an odd offset must stop
with one line naming the op, variant and argument, before anything is launched. On the CPU: the cubin
loader and the stream are faked, the rest is the runtime's own code."""
import pytest
import torch

from engc.cuda import records
from engc.runtime import gpu_ops

ARGS = [("q_ptr", "*bf16"), ("k_cache_ptr", "*bf16"), ("context_lens_ptr", "*i32"), ("scale", "fp32"),
        ("num_splits", "i32"), ("global_scratch", "*i8"), ("profile_scratch", "*i8")]
RECORD = {"op": "paged_attention", "variant": "decode", "arch": "sm90", "entry": "paged_decode_kernel",
          "cubin": "kernels/sm90/paged_attention.decode.cubin", "ptx": "kernels/sm90/paged_attention.decode.ptx",
          "num_warps": 4, "shared_mem": 0, "args": [{"name": n, "type": t} for n, t in ARGS],
          "scratch_params": 2, "align": 16, "launch": {}}


class FakeKernel:
    def __init__(self, signature):
        self.signature = signature
        self.launched = []

    def launch(self, grid, values, stream):
        self.launched.append(values)


class FakeBundle:
    manifest = {"kernels": [RECORD]}

    def read(self, path):
        return b""


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(gpu_ops, "require_cuda", lambda: None)
    monkeypatch.setattr(records, "load_kernel", lambda image, entry, sig, **kw: FakeKernel(sig))
    monkeypatch.setattr(gpu_ops, "current_stream", lambda: 0)
    return gpu_ops.BundleKernels(FakeBundle(), "sm90")


def test_aligned_tensors_launch_as_their_addresses(kernels):
    q, cache = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    ctx = torch.ones(4, dtype=torch.int32)
    # odd scalars are values, not addresses; a null pointer (None or 0) is aligned
    kernels.run("paged_attention", [("decode", (1, 1, 1), [q, cache, ctx, 0.125, 3, 0, 0]),
                                    ("decode", (1, 1, 1), [q, None, ctx, 0.125, 1, 0, 0])])
    kernel = kernels.kernels[("paged_attention", "decode")]
    assert kernel.signature == "pppfi"
    assert kernel.launched == [[q.data_ptr(), cache.data_ptr(), ctx.data_ptr(), 0.125, 3],
                               [q.data_ptr(), None, ctx.data_ptr(), 0.125, 1]]


def test_a_misaligned_view_is_refused_by_name_before_launch(kernels):
    q, ctx = torch.zeros(64, dtype=torch.bfloat16), torch.ones(4, dtype=torch.int32)
    cache = torch.zeros(65, dtype=torch.bfloat16)[1:]   # contiguous, 2 bytes past an aligned start
    assert cache.is_contiguous() and cache.data_ptr() % 16 == 2
    with pytest.raises(ValueError, match=r"^paged_attention\.decode: argument k_cache_ptr is at 0x[0-9a-f]+, "
                                         r"not 16-byte aligned"):
        kernels.run("paged_attention", [("decode", (1, 1, 1), [q, cache, ctx, 0.125, 3, 0, 0])])
    assert kernels.kernels[("paged_attention", "decode")].launched == []


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_gpu_sampler_parameter_rows_start_aligned(rows, monkeypatch):
    """SamplingKernels uploads temperature, top_k, top_p, the draws and min_p as one [5, n] block and passes its
    rows (top_k as an int32 view); each must start 16-byte aligned (one sequence once put top_p 8 bytes off,
    which the launch check refused)."""
    from engc.runtime.sampler import SamplingKernels
    from engc.runtime.sampling import SamplingParams
    from engc.runtime.sequence import Sequence

    class Kernels:
        consts = {"sampling": {"stats_fp32": {"SPLITS": 2, "NGROUPS": 8, "NCAND": 16}}}
        launches = []

        def run(self, op, launches):
            self.launches += launches

    k = Kernels()
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0.5 + i, top_k=3, top_p=0.9, min_p=0.05, seed=i))
            for i in range(rows)]
    SamplingKernels(k, torch.device("cpu"))(torch.randn(rows, 32), seqs)
    _variant, grid, args = k.launches[1]    # bound: every row parameter
    assert grid[0] == rows
    for t in args[1:6]:
        assert t.data_ptr() % 16 == 0 and t.shape[0] >= rows
    assert len({t.untyped_storage().data_ptr() for t in args[1:6]}) == 1   # one block, one upload
    assert [t.dtype for t in args[1:6]] == [torch.float32, torch.int32, torch.float32, torch.float32, torch.float32]
    assert args[1][:rows].tolist() == pytest.approx([0.5 + i for i in range(rows)])
    assert args[2][:rows].tolist() == [3] * rows and args[3][:rows].tolist() == pytest.approx([0.9] * rows)
    assert args[5][:rows].tolist() == pytest.approx([0.05] * rows)
    assert args[7].shape[0] >= rows * 16 and args[8].shape[0] >= rows * 16   # the candidate slots


def test_cuda_templates_can_be_left_unloaded(monkeypatch):
    """ENGC_DEBUG=no-cuda-templates: the bundle's nvcc-built kernels are not loaded, so the launch rules, which take
    them only where present, fall back to the Triton kernels (the cluster decode to Triton's decode_rotary)."""
    cluster = dict(RECORD, variant="decode_rotary_cluster", nvcc_version="13.0", scratch_params=0,
                   args=RECORD["args"][:-2], launch={"cluster": 8, "max_seqs": 1, "max_context": 1024})

    class TwoKernels(FakeBundle):
        manifest = {"kernels": [RECORD, cluster]}

    monkeypatch.setattr(gpu_ops, "require_cuda", lambda: None)
    monkeypatch.setattr(records, "load_kernel", lambda image, entry, sig, **kw: FakeKernel(sig))
    assert set(gpu_ops.BundleKernels(TwoKernels(), "sm90").consts["paged_attention"]) == {
        "decode", "decode_rotary_cluster"}
    monkeypatch.setenv("ENGC_DEBUG", "no-cuda-templates")
    kernels = gpu_ops.BundleKernels(TwoKernels(), "sm90")
    assert set(kernels.consts["paged_attention"]) == {"decode"}
    assert list(kernels.kernels) == [("paged_attention", "decode")]
