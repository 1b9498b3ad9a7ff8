"""EngineConfig from arguments and POCKETJAX_* variables: precedence, parsing, typed errors, the compile cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import pocketjax as pj
from pocketjax.engine.config import ENVIRONMENT, EngineConfig, default_compile_cache_dir, use_compile_cache
from pocketjax.errors import ConfigError
from pocketjax.serve.cli import main

ENV = {"POCKETJAX_MAX_BATCH_SIZE": "3", "POCKETJAX_MAX_SEQ_LEN": "96", "POCKETJAX_PREFILL_CHUNK": "16",
       "POCKETJAX_ATTENTION_IMPL": "xla", "POCKETJAX_KV_DTYPE": "int8"}


def test_environment_fills_what_the_caller_leaves_out():
    config = EngineConfig.of(environ=ENV, max_seq_len=64)
    assert (config.max_batch_size, config.max_seq_len, config.prefill_chunk) == (3, 64, 16)  # the argument wins
    assert (config.attention_impl, config.kv_dtype, config.compile_cache_dir) == ("xla", "int8", None)
    assert EngineConfig.of(environ={}) == EngineConfig()  # nothing set: the defaults
    assert EngineConfig.of(environ={"POCKETJAX_MAX_BATCH_SIZE": " "}) == EngineConfig()  # blank is unset
    explicit = EngineConfig(max_batch_size=5)
    assert EngineConfig.of(explicit, environ=ENV) == explicit  # a whole config given: every field is explicit


@pytest.mark.parametrize("variable, value, match", [
    ("POCKETJAX_MAX_BATCH_SIZE", "four", "POCKETJAX_MAX_BATCH_SIZE='four' is not an integer"),
    ("POCKETJAX_MAX_SEQ_LEN", "0", "POCKETJAX_MAX_SEQ_LEN='0': max_seq_len must be a positive integer"),
    ("POCKETJAX_PREFILL_CHUNK", "1.5", "POCKETJAX_PREFILL_CHUNK='1.5' is not an integer"),
    ("POCKETJAX_ATTENTION_IMPL", "cuda", "POCKETJAX_ATTENTION_IMPL='cuda': attention_impl must be one of"),
    ("POCKETJAX_KV_DTYPE", "int3", "POCKETJAX_KV_DTYPE='int3': kv_dtype='int3' is not supported"),
])
def test_malformed_variable_is_a_config_error_naming_it(variable, value, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.of(environ={variable: value})


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown engine option.*max_batch"):
        EngineConfig.of(max_batch=4)


def test_engine_llm_and_cli_read_the_environment(monkeypatch, capsys, hf_checkpoint):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    model = pj.load_model(folder)
    for variable, value in ENV.items():
        monkeypatch.setenv(variable, value)
    engine = pj.Engine(model, max_batch_size=2)
    assert (engine.num_slots, engine.max_seq_len, engine.config.kv_dtype, engine.impl) == (2, 96, "int8", "xla")
    with pj.LLM(model, max_seq_len=64) as llm:
        assert (llm.engine.num_slots, llm.engine.max_seq_len, llm.engine.config.prefill_chunk) == (3, 64, 16)
        out = llm.generate([[1, 2, 3]], pj.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 3
    assert main(["info", "--model", str(folder), "--max-batch-size", "5"]) == 0
    info = json.loads(capsys.readouterr().out)
    plan = info["memory_plan"]
    assert set(info["placed_bytes"].values()) == {plan["weights"]}  # what load_model placed, as planned
    monkeypatch.delenv("POCKETJAX_MAX_BATCH_SIZE")
    assert main(["info", "--model", str(folder), "--max-batch-size", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_plan"] == plan  # the flag wins over the variable
    assert main(["info", "--model", str(folder)]) == 0
    unflagged = json.loads(capsys.readouterr().out)["memory_plan"]
    monkeypatch.setenv("POCKETJAX_MAX_BATCH_SIZE", "5")
    assert main(["info", "--model", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["memory_plan"] == plan != unflagged  # the variable sizes it
    monkeypatch.setenv("POCKETJAX_MAX_SEQ_LEN", "-3")
    with pytest.raises(ConfigError, match="POCKETJAX_MAX_SEQ_LEN"):
        pj.Engine(model)


def test_compile_cache_default_is_per_user_and_off_turns_it_off(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    assert default_compile_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pocketjax" / "xla"
    assert default_compile_cache_dir({"XDG_CACHE_HOME": "rel"}) == home / ".cache" / "pocketjax" / "xla"
    assert default_compile_cache_dir({}) == home / ".cache" / "pocketjax" / "xla"
    variable = ENVIRONMENT["compile_cache_dir"]
    assert EngineConfig.of(environ={variable: "off"}).compile_cache_dir == "off"
    assert EngineConfig.of(environ={variable: " "}).compile_cache_dir is None  # blank is unset: the default
    with pytest.raises(ConfigError, match="compile_cache_dir must be a folder path or 'off'"):
        EngineConfig.of(compile_cache_dir="")
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match="a_file/xla' cannot be created"):
        use_compile_cache(blocked / "xla")
    before = jax.config.jax_compilation_cache_dir
    try:  # JAX's own folder, once set, wins over the default; "off" never touches it
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_own"))
        use_compile_cache(None)
        use_compile_cache("off")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax_own")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert not (tmp_path / "jax_own").exists() and not home.exists()


def test_compile_cache_keeps_programs_across_processes(tmp_path, hf_checkpoint):
    """Separate processes: JAX's compilation cache setting is process-wide."""
    folder, xdg = hf_checkpoint("qwen3_gqa4_headdim"), tmp_path / "xdg"
    code = (f"import pocketjax as pj; llm = pj.LLM({str(folder)!r}, max_batch_size=1, max_seq_len=64); "
            "print(llm.generate([[1, 2, 3]], pj.SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids); "
            "llm.close()")
    variable = ENVIRONMENT["compile_cache_dir"]
    env = {k: v for k, v in os.environ.items() if k != variable and not k.startswith("JAX_COMPILATION_CACHE")}

    def run(**extra: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def entries(cache: Path) -> list[str]:
        return sorted(p.name for p in cache.rglob("*") if p.is_file())

    first = run(XDG_CACHE_HOME=str(xdg))  # nothing set: the per-user folder
    cache = xdg / "pocketjax" / "xla"
    written = entries(cache)
    assert written, "nothing was written to the default compile cache"
    assert run(XDG_CACHE_HOME=str(tmp_path / "elsewhere"), **{variable: str(cache)}) == first  # the folder named
    assert entries(cache) == written and not (tmp_path / "elsewhere").exists()  # all found, none added
    assert run(XDG_CACHE_HOME=str(tmp_path / "off"), **{variable: "off"}) == first
    assert not (tmp_path / "off").exists()


def test_an_engine_leaves_jaxs_compile_cache_alone_unless_asked(tmp_path, hf_checkpoint):
    """Process-wide JAX settings belong to the user: a bare Engine sets none; a folder given to it is a request."""
    code = ("import jax, pocketjax as pj; m = pj.load_model({folder!r}); "
            "pj.Engine(m, max_batch_size=1, max_seq_len=32{extra}); print(jax.config.jax_compilation_cache_dir)")
    env = {k: v for k, v in os.environ.items()
           if k != ENVIRONMENT["compile_cache_dir"] and not k.startswith("JAX_COMPILATION_CACHE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    folder = str(hf_checkpoint("qwen3_gqa4_headdim"))

    def run(extra: str = "") -> str:
        done = subprocess.run([sys.executable, "-c", code.format(folder=folder, extra=extra)], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run() == "None" and not (tmp_path / "xdg").exists()
    asked = tmp_path / "asked"
    assert run(f", compile_cache_dir={str(asked)!r}") == str(asked)
