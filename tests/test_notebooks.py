"""Every notebook in notebooks/ runs top to bottom without an error, and is committed clean (no outputs).

The kernel is this interpreter (`sys.executable`), whatever kernelspecs the machine has installed: each notebook runs
under a kernelspec written to a temporary folder and handed to the kernel manager directly, so neither `ipykernel
install` nor JUPYTER_PATH is involved. The kernel gets the repository root on PYTHONPATH (the package need not be
installed) and one persistent JAX compilation cache shared by the notebooks of this module, so a shape one notebook
compiled is not compiled again by the next (05 then measures shapes 01 and 02 compiled: ~17 s instead of ~60 s).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

pytestmark = pytest.mark.leg2_only  # no reference needed: CI runs them beside the shorter leg (~220 s off leg 1)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_slots_and_batching.ipynb", "03_kernels.ipynb", "04_tensor_parallel.ipynb",
             "05_benchmarks.ipynb", "06_research.ipynb", "07_rl.ipynb"]
CELL_TIMEOUT_S = 300
KERNEL_NAME = "python3"  # the name every notebook's metadata asks for


def write_kernelspec(folder: Path, **env: str) -> list[str]:
    """A kernelspec folder whose "python3" runs this interpreter with the repo importable; returns kernel_dirs."""
    spec_dir = folder / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
        "env": {
            "PYTHONPATH": python_path,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "TOKENIZERS_PARALLELISM": "false",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            **env,
        },
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return [str(folder / "kernels")]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> Path:
    """One persistent compilation cache for every notebook kernel of this module (fresh each session)."""
    return tmp_path_factory.mktemp("notebook_jax_cache")


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory, jax_cache) -> list[str]:
    # 05 finds no results here and measures instead of reading files
    empty = tmp_path_factory.mktemp("no_bench_results")
    return write_kernelspec(tmp_path_factory.mktemp("notebook_kernels"), JAX_COMPILATION_CACHE_DIR=str(jax_cache),
                            POCKETJAX_BENCH_RESULTS=str(empty / "*.json"))


def run_notebook(path: Path, kernel_dirs: list[str]):
    """Execute a notebook in its own folder with a fresh kernel; returns the executed notebook (raises on error)."""
    nb = nbformat.read(path, as_version=4)
    ksm = KernelSpecManager(kernel_dirs=kernel_dirs, ensure_native_kernel=False)
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)
    assert km.kernel_spec.argv[0] == sys.executable
    client = nbclient.NotebookClient(nb, km=km, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT_S,
                                     startup_timeout=120, shutdown_kernel="immediate",
                                     resources={"metadata": {"path": str(path.parent)}})  # cwd: notebooks/
    client.execute(cleanup_kc=True)  # we made the kernel manager, so nbclient would leave the kernel running
    return nb


def test_notebooks_are_clean():
    """nbformat 4, valid, outputs stripped, and the first code cell configures JAX before importing it."""
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS
    for name in NOTEBOOKS:
        nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
        nbformat.validate(nb)
        assert nb.nbformat == 4, name
        assert nb.metadata.get("kernelspec", {}).get("name") == KERNEL_NAME, name
        code = [c for c in nb.cells if c.cell_type == "code"]
        for cell in code:
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs are committed"
        first = code[0].source
        for needle in ('os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")',
                       'os.environ.setdefault("JAX_PLATFORMS", "cpu")'):
            assert needle in first, f"{name}: first code cell lacks {needle}"
            assert first.index(needle) < first.index("import jax"), f"{name}: {needle} must come before jax"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_dirs):
    t0 = time.perf_counter()
    nb = run_notebook(NOTEBOOK_DIR / name, kernel_dirs)
    elapsed = time.perf_counter() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code"), f"{name}: cells skipped"
    print(f"{name}: {elapsed:.1f} s")


def test_benchmarks_notebook_reads_results(tmp_path, jax_cache):
    """05 plots bench_engine.py JSON files when it finds some, without measuring anything itself."""
    results = tmp_path / "results"
    results.mkdir()
    records = [{"system": system, "dtype": "float32", "concurrency": c, "prefill_tok_s": 100.0 * c,
                "decode_tok_s": rate * c, "decode_step_ms": 1e3 / rate}
               for system, rate in (("pocketjax", 40.0), ("transformers", 25.0)) for c in (1, 2, 4, 8)]
    (results / "bench.json").write_text(json.dumps({"machine": {"cpu": "test"}, "records": records}))
    dirs = write_kernelspec(tmp_path, JAX_COMPILATION_CACHE_DIR=str(jax_cache),
                            POCKETJAX_BENCH_RESULTS=str(results / "*.json"))
    nb = run_notebook(NOTEBOOK_DIR / "05_benchmarks.ipynb", dirs)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "8 benchmark records from 1 file(s)" in text
    assert "measured here" not in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
