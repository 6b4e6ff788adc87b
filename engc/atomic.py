"""Folders that appear whole or not at all: a failed build or quantization never leaves half a result."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(out: Path):
    """Yields a temporary sibling of `out`; on success it replaces `out`, on any failure it vanishes."""
    out = Path(out).resolve()
    tmp = out.with_name(out.name + ".engc-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
