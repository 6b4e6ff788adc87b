"""bench/decode_attention_bench.py's CPU side: variants parsed, each compiled with its override into a folder the GPU
side loads (cubin beside a JSON of its record and what it is)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_attention_bench as bench  # noqa: E402


def test_variants_parse_into_tune_overrides():
    assert bench.parse_variants("tuned:; n64s2: BLOCK_N=64,num_stages=2 ;capped:maxnreg=128") == {
        "tuned": {}, "n64s2": {"BLOCK_N": 64, "num_stages": 2}, "capped": {"maxnreg": 128}}


def _prepared(tmp_path, **options) -> dict:
    """bench.prepare on the tiny shape into tmp_path: {file stem: its JSON}."""
    bench.prepare(argparse.Namespace(shape="tiny", label="here", out=str(tmp_path), **options))
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}


def test_prepare_compiles_each_variant_with_its_override(tmp_path):
    metas = _prepared(tmp_path, kv="fp8", variants="tuned:;n16:BLOCK_N=16,maxnreg=128", kernel="decode")
    assert set(metas) == {"here__decode__fp8__tuned", "here__decode__fp8__n16"}
    for stem, meta in metas.items():
        assert (tmp_path / f"{stem}.cubin").read_bytes()[:4] == b"\x7fELF"
        assert meta["record"]["variant"] == "decode" and meta["kv"] == "fp8" and meta["kernel"] == "decode"
    assert metas["here__decode__fp8__n16"]["record"]["launch"]["BLOCK_N"] == 16
    assert metas["here__decode__fp8__n16"]["record"]["tune"]["maxnreg"] == 128
    assert "maxnreg" not in metas["here__decode__fp8__tuned"]["record"]["tune"]


def test_prepare_compiles_the_rotary_decode_where_asked(tmp_path):
    """--kernel decode_rotary: the kernel fused with the rotary, each variant's override in its record."""
    metas = _prepared(tmp_path, kv="auto", variants="tuned:;n16:BLOCK_N=16", kernel="decode_rotary")
    assert set(metas) == {"here__decode_rotary__auto__tuned", "here__decode_rotary__auto__n16"}
    assert all(m["record"]["variant"] == "decode_rotary" and m["kernel"] == "decode_rotary" for m in metas.values())
    assert metas["here__decode_rotary__auto__n16"]["record"]["launch"]["BLOCK_N"] == 16
