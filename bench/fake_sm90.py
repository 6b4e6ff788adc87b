"""A pytest plugin that makes this CPU machine pass for an sm90 GPU, only to fill a kernel cache for the GPU
tests: their bundle fixtures then build (compiling every kernel the tests will launch) and the tests fail
here, as they must. Carry the cache to the GPU machine and run the same files there against it, so the
cubins under test are the ones this machine's Triton compiled:

    here:  ENGC_KERNEL_CACHE=$PWD/.kc/tests PYTHONPATH=bench python3 -m pytest -q -p fake_sm90 -p no:cacheprovider \\
               tests/test_gpu.py tests/test_overlap.py tests/test_fp8.py tests/test_native.py tests/test_quant_lm_head.py
    there: ENGC_KERNEL_CACHE=$PWD/.kc/tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py ...

Run it without -x: every fixture must build.
"""
import torch

import engc.cuda.cubin as cubin

torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
cubin.cuda_available = lambda: True
