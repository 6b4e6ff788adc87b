"""Builds engc's default calibration corpus, engc/compiler/quantize/corpus/general.jsonl.gz.

    pip download --no-deps chatterbot-corpus==1.3.3 -d DIR      # a wheel
    pip download --no-deps --no-binary :all: wordcloud==1.9.6 -d DIR   # the sdist (its examples/ folder);
        # pip builds the sdist's metadata after the download: the tarball is kept even where that fails
    python scripts/build_calib_corpus.py DIR

Five sources of five domains (calibration.SOURCES names each with its licence), each cut into chunks
of about CHUNK characters at paragraph ends, the chunks interleaved by their position in their source,
so any set of evenly spaced calibration windows (calibration_samples) draws on every source in
proportion to its size, and no source is longer than CAP characters (the Python reference would
otherwise be a third of the corpus). One JSON line per chunk: {"source": name, "text": chunk}.
The texts of bench/quant_prose_ppl.py (the GPL-3, Vim's manual) are not among them, and the Python
reference contributes only calibration.python_reference's calibration half.
"""
from __future__ import annotations

import glob
import gzip
import json
import re
import sys
import tarfile
import zipfile
from pathlib import Path

import yaml

from engc.compiler.quantize.calibration import CORPUS_FILE, python_reference

CHUNK = 1500
CAP = 120_000


def wordcloud_example(sdist: str, name: str) -> str:
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"/examples/{name}"))
        return tar.extractfile(member).read().decode("utf-8-sig")


def alice(sdist: str) -> str:
    """The book only: Project Gutenberg's header and licence are cut (the text itself is public domain)."""
    text = wordcloud_example(sdist, "alice.txt")
    start = text.index("*** START OF THIS PROJECT GUTENBERG EBOOK")
    end = text.index("End of Project Gutenberg's")
    return text[text.index("\n", start) + 1:end].strip()


def rainbow(sdist: str) -> str:
    """Wikipedia's "Rainbow", printed to PDF and back: page headers, URLs and [n] citations dropped,
    lines wrapped by the page joined into paragraphs."""
    lines = []
    for line in wordcloud_example(sdist, "wiki_rainbow.txt").splitlines():
        if re.match(r"^\d+/\d+/\d+ Rainbow - Wikipedia$|^https?://", line.strip()):
            continue
        lines.append(re.sub(r"\[\d+\]", "", line).strip())
    paragraphs, current = [], []
    for line in lines:
        current.append(line)
        if line.endswith((".", ":", "?", "!")) or not line:
            paragraphs.append(" ".join(w for w in current if w))
            current = []
    paragraphs.append(" ".join(current))
    return "\n\n".join(p for p in paragraphs if len(p) > 40)


def dialogs(wheel: str) -> str:
    """chatterbot-corpus's English conversations, one exchange a paragraph; its coding file is left out
    (code, where the corpus wants prose)."""
    out = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if "/data/english/" in n and n.endswith(".yml")):
            if name.endswith("/coding.yml"):
                continue
            doc = yaml.safe_load(z.read(name))
            for conv in doc.get("conversations") or []:
                turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
                if len(turns) >= 2:
                    out.append("\n".join(turns))
    return "\n\n".join(out)


def chunks(text: str) -> list[str]:
    out, current = [], ""
    for para in re.split(r"\n\s*\n", text[:CAP]):
        para = para.strip()
        if para:
            current = f"{current}\n\n{para}" if current else para
        if len(current) >= CHUNK:
            out.append(current)
            current = ""
    return out + [current] * bool(current)


def build(folder: str) -> list[dict]:
    sdist = glob.glob(f"{folder}/wordcloud-*.tar.gz")[0]
    wheel = glob.glob(f"{folder}/chatterbot_corpus-*.whl")[0]
    texts = {"alice": alice(sdist), "constitution": wordcloud_example(sdist, "constitution.txt").strip(),
             "rainbow": rainbow(sdist), "dialogs": dialogs(wheel),
             "python_reference": python_reference("calibration")}
    keyed = []
    for name, text in texts.items():
        parts = chunks(text)
        keyed += [((i + 0.5) / len(parts), name, part) for i, part in enumerate(parts)]
    return [{"source": name, "text": part} for _, name, part in sorted(keyed, key=lambda k: (k[0], k[1]))]


def main():
    rows = build(sys.argv[1])
    out = Path(CORPUS_FILE)
    out.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same texts give the same bytes
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    for name in sorted({r["source"] for r in rows}):
        print(name, sum(len(r["text"]) for r in rows if r["source"] == name), "characters")


if __name__ == "__main__":
    main()
