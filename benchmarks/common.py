"""What the benchmark scripts share: the options most of them take (`add_options`; `add_quick` and `parse` for
--quick), the checkpoint a `--model` names (`model_folder`), the record of the machine a result was measured on
(`machine`, `versions`), the JSON file (`write_json`) and the markdown table printed last (`markdown_table`).

Imports neither jax nor pocketjax at the top: startup.py's child processes time those imports themselves.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

DEFAULT_CACHE_DIR = "/tmp/pocketjax-bench"
DTYPES = ("float32", "bfloat16", "float16")  # pocketjax.model.config.DTYPES (not imported here: see above)

HELP = {
    "model": "HF folder or a preset of benchmarks/presets.py",
    "dtype": "the checkpoint's dtype (a preset is built in it)",
    "concurrency": "concurrent requests (comma-separated: one run each)",
    "prompt_len": "prompt tokens per request",
    "gen_len": "tokens generated per request (the first by prefill)",
    "steps": "timed decode steps per run",
    "repeats": "timed runs per figure",
    "cache_dir": "where presets are built",
    "json": "write the results here",
    "keys": "cached positions each decode row attends to (kernel_ab --weights attention)",
}


def add_options(p: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Add the options named by `defaults`, in their order, each with its default: `prompt_len=32` adds
    `--prompt-len` taking an int (a float default takes floats, any other a string), `dtype="float32"` adds
    `--dtype` (one of DTYPES); the help comes from HELP."""
    for name, default in defaults.items():
        kwargs = dict(default=default, help=HELP.get(name))
        if name == "dtype":
            kwargs["choices"] = DTYPES
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            kwargs["type"] = type(default)
        p.add_argument("--" + name.replace("_", "-"), **kwargs)
    return p


def add_quick(p: argparse.ArgumentParser, quick: dict, note: str = "") -> argparse.ArgumentParser:
    """`--quick`: a smoke run with `quick`'s settings for every option left at its default (see `parse`)."""
    p.add_argument("--quick", action="store_true", help=f"smoke run{note}: {quick} for whatever is not given")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None, quick: dict | None = None) -> dict:
    """The parsed options as a dict; under --quick, `quick`'s values replace the options left at their defaults (so
    `--quick --concurrency 1,2` keeps 1,2)."""
    args = vars(p.parse_args(argv))
    if quick and args.get("quick"):
        args.update({k: v for k, v in quick.items() if args[k] == p.get_default(k)})
    return args


def parse_ints(value) -> list[int]:
    """"1,4,8" (or a list) -> [1, 4, 8]."""
    if isinstance(value, str):
        return [int(v) for v in value.split(",") if v.strip()]
    return [int(v) for v in value]


def model_folder(model: str, cache_dir: str = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """The checkpoint folder `--model` names: a preset of presets.py is built once into cache_dir/<preset>-<dtype>;
    anything else must be an HF folder."""
    from benchmarks.presets import PRESETS, build_preset

    if model in PRESETS:
        return build_preset(model, Path(cache_dir) / f"{model}-{dtype}", dtype)
    folder = Path(model)
    if not (folder / "config.json").exists():
        raise SystemExit(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an HF folder")
    return folder


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which can be fewer than the machine's."""
    return len(os.sched_getaffinity(0))


def _jax():
    import jax

    return jax


FIELDS = {  # name in the JSON -> how it is read
    "platform": platform.platform,
    "python": platform.python_version,
    "cpu": cpu_name,
    "cores": os.cpu_count,  # the machine's
    "cpus": os.cpu_count,  # the same, under the name bench_serve.py and lm_eval_check.py write
    "usable_cores": usable_cores,
    "jax": lambda: _jax().__version__,
    "backend": lambda: _jax().default_backend(),
    "devices": lambda: [str(d) for d in _jax().devices()],
    "device": lambda: str(_jax().devices()[0]),
    "loadavg": lambda: list(os.getloadavg()),
}


def machine(*fields: str, **values) -> dict:
    """The record of the machine a result comes from: each named field of FIELDS read now, then `values` (a script's
    own fields, or one of FIELDS it reads otherwise: the key keeps its place)."""
    return {**{name: FIELDS[name]() for name in fields}, **values}


def versions(*packages: str) -> dict[str, str | None]:
    """Each installed distribution's version (None where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def write_json(path: str | Path | None, result: dict, indent: int = 2) -> None:
    """Write `result` to `path`, its folder made first; nothing when no path was given. A value JSON cannot encode
    is written as its str(): a long run's numbers are never lost to it."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=indent, default=str))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table: the header, its rule, then one line per row (each cell as str())."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
