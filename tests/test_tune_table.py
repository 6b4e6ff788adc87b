"""The tune table is data: table_<arch>.jsonl, one entry a line with a reason, read strictly."""
import json

import pytest

from engc.compiler import tune
from engc.compiler.tune import table
from engc.kernels.skinny_gemm import specs as skinny_kernels
from engc.kernels.int4_gemm import specs as int4_gemm_kernels
from engc.kernels.gemv import specs as gemv_kernels
from engc.kernels.fp8_linear import specs as fp8_linear_kernels


def test_every_entry_has_a_reason_and_every_built_class_an_entry():
    for arch in tune.ARCHS:
        rows = [json.loads(line) for line in (table.HERE / f"table_{arch}.jsonl").read_text().splitlines()]
        assert rows and all(len(r["why"]) >= 20 and "\n" not in r["why"] for r in rows)
        assert len({r["key"] for r in rows}) == len(rows)
    for arch in tune.ARCHS:
        for bucket in (*gemv_kernels.M_CLASSES, *gemv_kernels.PLAIN_CLASSES):
            assert f"{arch}/gemv/*/{bucket}" in tune.TUNE
        for bucket in skinny_kernels.M_CLASSES:
            assert f"{arch}/skinny_gemm/*/{bucket}" in tune.TUNE
        for bucket in int4_gemm_kernels.M_CLASSES:
            assert f"{arch}/int4_gemm/*/{bucket}" in tune.TUNE
    for bucket in fp8_linear_kernels.M_CLASSES:
        assert f"sm90/fp8_linear/*/{bucket}" in tune.TUNE


def test_lists_are_read_as_tuples():
    """Launch rules read `serves` and `silu_by_n` as nested tuples, as the kernel cache hashes them."""
    serves = tune.TUNE["sm90/gemv/*/m<=1/n8k512w2"]["serves"]
    assert isinstance(serves, tuple) and all(isinstance(r, tuple) for r in serves)
    assert isinstance(tune.TUNE["sm90/gemv/*/m<=1"]["silu_by_n"][0][2], dict)


@pytest.mark.parametrize("line, message", [
    ('{"key": "rms_norm/*/any", "entry": {"num_warps": 4}}', "why"),
    ('{"key": "rms_norm", "why": "a reason", "entry": {}}', "op/variant/bucket"),
    ('{"key": "x/y/z", "why": "one", "entry": {}}\n{"key": "x/y/z", "why": "two", "entry": {}}', "twice"),
])
def test_a_malformed_line_is_refused_with_its_place(tmp_path, monkeypatch, line, message):
    (tmp_path / "table_sm90.jsonl").write_text(line + "\n")
    monkeypatch.setattr(table, "HERE", tmp_path)
    with pytest.raises(ValueError, match=message):
        table.read_table("sm90")


def test_a_tune_file_may_cap_registers_where_the_entry_does_not():
    """maxnreg is an optional field (like PDL and smem_carveout): a --tune file may add it to any entry, and
    make_spec carries it to the compile options (codegen/aot.py). A misspelling is refused by name."""
    from engc.compiler.codegen.kernel_spec import make_spec
    from engc.errors import UserError
    key = "sm90/paged_attention/decode/d>128"
    assert "maxnreg" not in tune.TUNE[key]
    entries = tune.check_overrides({key: {"maxnreg": 96}})
    with tune.overridden(entries):
        spec = make_spec("paged_attention", "decode", "sm90", "paged_decode_kernel", {}, {}, "d>128")
    assert spec.tune["maxnreg"] == 96 and "maxnreg" not in tune.TUNE[key]
    with pytest.raises(UserError, match="maxnregs"):
        tune.check_overrides({key: {"maxnregs": 96}})
