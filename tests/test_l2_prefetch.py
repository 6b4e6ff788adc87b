"""The L2 prefetch (kernels/l2_prefetch, runtime/l2_prefetch): the kernel under TRITON_INTERPRET=1 reads
exactly the bytes its launch rule promises (the XOR of every word per program against the reference),
its asm variant compiles for sm90, and the plan puts one window before each projection of a real
program, with attention windows before o_proj.

The kernel checks run in a child process that switches the interpreter on before triton is imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (bytes in the tensor, bytes asked for, BLOCK, programs): fewer blocks than programs, uneven splits,
# a ragged tail that is left out, a request larger than the tensor, and nothing at all
CASES = {"even": (64 * 1024, 64 * 1024, 128, 8), "uneven": (77 * 512, 77 * 512, 128, 8),
         "few_blocks": (3 * 512 + 100, 10 ** 6, 128, 16), "head_only": (40 * 512, 9 * 512 + 7, 128, 4),
         "empty": (300, 300, 128, 4)}


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"checks crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_reads_the_promised_bytes(report, case):
    assert report[case]["ok"], report[case]


def test_plan_rule():
    from engc.kernels import l2_prefetch
    assert l2_prefetch.plan(0, 128, 8) == (0, 0, 0)
    assert l2_prefetch.plan(10 * 512, 128, 4) == (10, 3, 4)     # 3 + 3 + 3 + 1 blocks
    assert l2_prefetch.plan(10 * 512, 128, 16) == (10, 1, 10)   # never an idle program
    assert l2_prefetch.plan(33_554_432, 2048, 264) == (4096, 16, 256)


def test_windows_of_a_real_program(tiny_bundle):
    from engc.bundle.program import ENGC_DOMAIN, parse_program
    from engc.bundle.reader import open_bundle
    from engc.runtime.l2_prefetch import plan
    from safetensors import safe_open
    bundle = open_bundle(tiny_bundle("llama"))
    program = parse_program(bundle.read(bundle.manifest["program"]))
    with safe_open(str(bundle.file(bundle.manifest["weights"][0])), framework="pt") as f:
        weights = dict.fromkeys(f.keys())
    windows = plan(program.nodes, weights)
    layers = bundle.config.num_layers
    attention = [w for w in windows if w.attention]
    assert len(attention) == layers            # rotary + attention before each o_proj
    for w in windows:
        between = [(n.domain, n.op) for n in program.nodes[w.fork:w.join]]
        assert between and program.nodes[w.join].inputs[1] == w.weight
        assert ((ENGC_DOMAIN, "PagedAttention") in between) == w.attention
    # qkv and gate_up after their norms, o_proj after attention, the head after the final norm; the
    # down projection follows gate_up directly and gets none
    assert len(windows) == 3 * layers + 1
    assert program.nodes[windows[-1].join].inputs[1] in weights


def test_asm_variant_compiles_for_sm90():
    pytest.importorskip("triton")
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import l2_prefetch_specs
    res = compile_specs(l2_prefetch_specs("sm90", {"MODE": 1}), progress=None, jobs=1)
    ptx = next(data for path, data in res.files.items() if path.endswith(".ptx")).decode()
    assert "prefetch.global.L2" in ptx


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def main():
    import torch
    from engc.compiler.codegen.specs import l2_prefetch_specs
    from engc.kernels import l2_prefetch
    torch.manual_seed(0)
    report = {}
    for name, (size, nbytes, block, programs) in CASES.items():
        spec = l2_prefetch_specs("sm90", {"BLOCK": block, "programs": programs})[0]
        data = torch.randint(-2 ** 31, 2 ** 31 - 1, (size // 4,), dtype=torch.int32).view(torch.bfloat16)
        out = torch.full((programs,), 12345, dtype=torch.int32)
        launches = l2_prefetch.launch(data, nbytes, out, {"default": spec.launch})
        for _, grid, args in launches:
            spec.fn()[grid](*args[:-2], **spec.constexprs)
        want = l2_prefetch.checksums(data, nbytes, block, programs)
        got = out[:len(want)]
        report[name] = {"ok": torch.equal(got, want) and (bool(launches) == (len(want) > 0)),
                        "programs": len(want), "got": got.tolist()[:4], "want": want.tolist()[:4]}
    print(json.dumps(report))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
