import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(family, **overrides) -> folder of a tiny random HF checkpoint, made once per session."""
    from tiny_models import make_tiny
    made = {}

    def make(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny(family, tmp_path_factory.mktemp(f"tiny_{family}"), **overrides)
        return made[key]
    return make


@pytest.fixture(scope="session")
def tiny_bundle(tiny_dir, tmp_path_factory):
    """tiny_bundle(family, **overrides) -> a built CPU bundle of that tiny checkpoint."""
    from engc.compiler.build import BuildOptions, build
    made = {}

    def make(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"bundle_{family}") / "b"
            build(str(tiny_dir(family, **overrides)), out, BuildOptions())
            made[key] = out
        return made[key]
    return make
