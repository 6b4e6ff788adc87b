"""Dependencies flow one way: compiler -> bundle <- runtime, both over engc.cuda and the op contracts in
engc/kernels. A machine that serves needs no compiler, Triton or transformers; the compiler never needs
the runtime. Checked on the source (every import, also those inside functions) and on what importing
the serving side really loads."""
import ast
import subprocess
import sys
from pathlib import Path

ENGC = Path(__file__).resolve().parents[1] / "engc"
COMPILE_ONLY = ("engc.compiler", "triton", "transformers", "gguf")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def offenders(files, banned) -> dict[str, list[str]]:
    found = {}
    for f in files:
        bad = sorted(n for n in imports(f) if any(n == b or n.startswith(b + ".") for b in banned))
        if bad:
            found[str(f.relative_to(ENGC))] = bad
    return found


def contracts() -> list[Path]:
    """The op contracts: each kernel folder's __init__.py, bind.py and the other modules beside them, except
    the compiler's parts: specs.py and cuda_specs.py (what a build compiles) and any module holding Triton code, however it is
    named."""
    return [f for f in ENGC.joinpath("kernels").rglob("*.py")
            if f.name in ("__init__.py", "bind.py")
            or (f.name not in ("specs.py", "cuda_specs.py") and "triton" not in {n.split(".")[0] for n in imports(f)})]


def test_the_compiler_never_imports_the_runtime():
    assert offenders(ENGC.joinpath("compiler").rglob("*.py"), ("engc.runtime", "engc.llm")) == {}


def test_the_serving_side_never_imports_the_compiler():
    files = [*ENGC.joinpath("runtime").rglob("*.py"), *ENGC.joinpath("bundle").rglob("*.py"),
             *ENGC.joinpath("cuda").rglob("*.py"), ENGC / "llm.py", *contracts()]
    assert offenders(files, COMPILE_ONLY) == {}
    assert offenders([*ENGC.joinpath("bundle").rglob("*.py"), *ENGC.joinpath("cuda").rglob("*.py"), *contracts()],
                     ("engc.runtime",)) == {}


def test_loading_the_serving_side_loads_no_compiler():
    ops = sorted(p.name for p in ENGC.joinpath("kernels").iterdir() if (p / "__init__.py").is_file())
    code = ("import sys, engc.cli, engc.llm, engc.cuda.records\n"
            "import engc.runtime.engine, engc.runtime.loader, engc.runtime.gpu_ops, engc.runtime.server.app\n"
            + "".join(f"import engc.kernels.{op}\n" for op in ops) +
            "bad = [m for m in sys.modules if m.split('.')[0] in ('triton', 'transformers', 'gguf')"
            " or m.startswith('engc.compiler')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_engc_run_spawns_the_engine_before_it_imports_the_server():
    """engc run spawns the engine's process before it imports torch and the server's modules (seconds), so the
    child's imports and load overlap the parent's: what the parent has imported when it spawns."""
    heavy = ("torch", "fastapi", "uvicorn", "engc.runtime.engine", "engc.runtime.engine_process",
             "engc.runtime.server.app")
    code = ("import sys\n"
            "import engc.runtime.engine_spawn as engine_spawn\n"
            "def spawn(build):\n"
            f"    print(sorted(m for m in {heavy!r} if m in sys.modules), build.func.__module__, flush=True)\n"
            "    sys.exit(0)\n"
            "engine_spawn.spawn = spawn\n"
            "from engc.cli import main\n"
            "main(['run', 'bundle', '--port', '0'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "[] engc.runtime.engine_spawn\n", r.stdout + r.stderr
