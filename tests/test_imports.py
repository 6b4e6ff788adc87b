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
