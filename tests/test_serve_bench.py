"""bench/serve_bench.py against a live engc server: every level streams its requests with no error, reports
throughput and latency percentiles from the server's own usage (a level shared by several client processes
too), and the plot is written."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from live_server import LiveServer  # noqa: E402
from serve_bench import main, percentile, workload  # noqa: E402


def test_workload_is_seeded_and_mixes_lengths():
    a, b = workload("mix", 50, 3, 0, 0), workload("mix", 50, 3, 0, 0)
    assert a == b and len({tokens for _, tokens in a}) > 10 and len({len(p.split()) for p, _ in a}) > 10
    assert all(len(p.split()) == 12 and t == 5 for p, t in workload("fixed", 3, 0, 12, 5))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 99) is None


def test_levels_against_a_live_server(tiny_bundle, tmp_path):
    out = tmp_path / "engc.json"
    with LiveServer(tiny_bundle("llama")) as server:
        main(["run", "--url", server.url, "--model", server.model, "--label", "engc", "--workload", "fixed",
              "--input-words", "6", "--output-len", "5", "--concurrency", "1,3", "--rates", "50",
              "--requests", "6", "--out", str(out)])
        # a level shared by two client processes: every request answered, counted once
        main(["run", "--url", server.url, "--model", server.model, "--workload", "fixed", "--input-words", "6",
              "--output-len", "5", "--concurrency", "4", "--procs", "2", "--requests", "8",
              "--out", str(tmp_path / "two.json")])
    two, = json.loads((tmp_path / "two.json").read_text())["levels"]
    assert two["client_processes"] == 2 and two["requests"] == 16 and two["errors"] == 0, two
    assert two["output_tok_s"] > 0 and two["itl_ms_p50"] is not None
    report = json.loads(out.read_text())
    assert [lv.get("concurrency") or lv.get("rate") for lv in report["levels"]] == [1, 3, 50.0]
    for lv in report["levels"]:
        assert lv["errors"] == 0 and lv["requests"] >= 6, lv
        assert lv["output_tok_s"] > 0 and lv["prompt_tokens_mean"] > 0
        assert lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and lv["itl_ms_p50"] <= lv["itl_ms_p99"]
    pytest.importorskip("matplotlib")
    main(["plot", str(out), str(out), "-o", str(tmp_path / "serve.png")])
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
