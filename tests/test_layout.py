"""The package layout is the architecture: imports flow one way (model -> engine -> serve), without cycles.

`python tests/test_layout.py` prints the module import graph and each module's size.
"""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A module may import only from its own layer or those before it; the kernels import nothing of pocketjax.
LAYERS = ("errors", "model", "nnx", "engine", "serve", "training")  # nnx: the model as a Flax NNX module
HTTP = "pocketjax.serve.http"  # imports the rest of serve; nothing there but the command line imports it
SERVE_CLI = "pocketjax.serve.cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The project modules `path` imports (relative imports resolved), as dotted names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    # Imports under `if TYPE_CHECKING:` count too: a cycle hidden from the interpreter is still a cycle in the design.
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names if resolve(f"{target}.{a.name}")]
            candidates = submodules if len(submodules) == len(node.names) else submodules + [target]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c.split(".")[0] in ("pocketjax", "pallas_kernels") and resolve(c)}
    return found


def resolve(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "pocketjax").rglob("*.py")) + sorted((ROOT / "pallas_kernels").rglob("*.py"))
    return {module_name(f): {module_name(resolve(i)) for i in imports(f)} - {module_name(f)} for f in files}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "pocketjax" and len(parts) > 1 else parts[0]


def test_imports_flow_one_way():
    for module, deps in graph().items():
        if module == "pocketjax" or layer(module) == "__main__":
            continue  # the package root re-exports the public API from every layer
        for dep in deps:
            assert dep != "pocketjax", f"{module} imports the package root"
            if module.startswith("pallas_kernels"):
                assert not dep.startswith("pocketjax"), f"{module} imports {dep}: the kernels stand alone"
            elif dep.startswith("pocketjax"):
                assert LAYERS.index(layer(dep)) <= LAYERS.index(layer(module)), f"{module} imports {dep}"


def test_in_process_serving_never_imports_http():
    """serve.http sits on the in-process serving modules (scheduler, handles, LLM, tokenizer), never under them:
    they serve Python callers without FastAPI. The command line starts both, so it may import either."""
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    for module, deps in graph().items():
        if not within(module, "pocketjax.serve") or within(module, HTTP) or module == SERVE_CLI:
            continue
        http = sorted(d for d in deps if within(d, HTTP))
        assert not http, f"{module} imports {', '.join(http)}: the HTTP layer imports serving, not the reverse"


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if dep.endswith("__init__") or dep not in g:
                continue
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in g:
        if module not in state and module != "pocketjax":
            visit(module, [module])


def test_import_pocketjax_leaves_training_out():
    code = "import sys, pocketjax; print(sorted(m for m in sys.modules if m.startswith('pocketjax.training')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


if __name__ == "__main__":
    for module, deps in graph().items():
        path = resolve(module)
        lines = len(path.read_text().splitlines())
        print(f"{module:40s} {lines:5d}  -> {', '.join(sorted(d.removeprefix('pocketjax.') for d in deps)) or '-'}")
