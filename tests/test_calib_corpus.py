"""The default calibration corpus is general prose of several domains, mixed throughout, apart from the
texts the prose benchmark scores, and `engc quantize` names it and counts its tokens."""
import re
from collections import Counter

from click.testing import CliRunner

from engc.cli import main
from engc.compiler.quantize import calibration
from engc.compiler.quantize.calibration import SOURCES, corpus_rows, default_corpus, python_reference


def test_every_listed_source_is_present_and_none_dominates():
    chars = Counter()
    for row in corpus_rows():
        chars[row["source"]] += len(row["text"])
    assert set(chars) == set(SOURCES) and len(SOURCES) >= 5
    total = sum(chars.values())
    assert total > 300_000
    for name, n in chars.items():
        assert 0.05 < n / total < 0.35, (name, n / total)
    for name, (what, origin, licence) in SOURCES.items():
        assert what and origin and licence, name


def test_sources_are_interleaved_so_any_window_set_sees_all_of_them():
    rows = corpus_rows()
    for part in range(4):  # every quarter of the corpus holds chunks of every source
        quarter = rows[part * len(rows) // 4:(part + 1) * len(rows) // 4]
        assert {r["source"] for r in quarter} == set(SOURCES), part


def test_the_corpus_is_prose_not_code():
    text = default_corpus()
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) > 60_000
    # English prose: the commonest words are function words, and code punctuation is rare
    common = [w for w, _ in Counter(w.lower() for w in words).most_common(8)]
    assert {"the", "and", "of", "to"} <= set(common), common
    assert sum(text.count(c) for c in "{}=;") / len(text) < 0.01


def test_the_benchmark_texts_and_the_held_out_reference_are_not_in_it():
    text = default_corpus()
    assert "GNU General Public License" not in text and "GENERAL PUBLIC LICENSE" not in text
    assert not re.search(r"\bvim\b", text, re.IGNORECASE)
    # the Python reference's topics share some paragraphs between halves: those may be there, no other
    calibration_half = python_reference("calibration")
    held_out = [p.strip() for p in python_reference("heldout").split("\n\n") if len(p.strip()) > 200]
    assert len(held_out) > 100 and not [p for p in held_out if p in text and p not in calibration_half]


def test_quantize_summary_names_the_corpus_and_its_tokens(tiny_dir, tmp_path):
    out = CliRunner().invoke(main, ["quantize", str(tiny_dir("llama")), "-o", str(tmp_path / "q"), "--method",
                                    "gptq", "--group-size", "32", "--calib-samples", "4", "--calib-seqlen", "16"])
    assert out.exit_code == 0, out.output
    line = next(ln for ln in out.output.splitlines() if ln.startswith("calibration:"))
    m = re.fullmatch(r"calibration: 64 tokens \(4 x 16\) of (.+), (\d+) tokens", line)
    assert m and m.group(1) == calibration.corpus_name(None), line
    assert all(name in m.group(1) for name in SOURCES) and int(m.group(2)) > 50_000
