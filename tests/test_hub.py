"""Repo ids resolve through huggingface_hub's own code, offline, in a hub cache laid out here as it lays one out."""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants

import pocketjax as pj
from pocketjax.errors import CheckpointError, ConfigError
from pocketjax.model.hub import resolve_checkpoint
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.tokenizer import Tokenizer

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

TINY, CODER = "tiny-org/tiny-qwen3", "pocket-org/pocket-coder"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[1]


def cache_repo(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """Lay `folder` out in `cache` as snapshot_download leaves a model repo (huggingface_hub's file_download.py):
    models--{owner}--{name}/blobs/<hash> holds each file, snapshots/<commit>/<file> links to it, refs/main names
    the commit (no newline: huggingface_hub reads the file whole)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / blob)
        (repo / "snapshots" / commit / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture(scope="module")
def home(hf_checkpoint, tmp_path_factory):
    """An HF_HOME whose hub cache holds the tiny random checkpoint and the embedded model."""
    home = tmp_path_factory.mktemp("hf_home")
    cache_repo(home / "hub", TINY, hf_checkpoint("qwen3_gqa4_headdim"))
    if (DEFAULT_MODEL / "model.safetensors").exists():
        cache_repo(home / "hub", CODER, DEFAULT_MODEL)
    return home


@pytest.fixture(autouse=True)
def offline(home, monkeypatch):
    """HF_HOME and HF_HUB_OFFLINE=1 for this process. huggingface_hub reads them into `constants` at import (the
    subprocess test checks that path), so here the constants are set as that import would have set them."""
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_repo_id_loads_like_its_folder(hf_checkpoint, home):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    by_id, by_folder = pj.load_model(TINY), pj.load_model(folder)
    snapshot = (home / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT).resolve()
    assert Path(by_id.path) == snapshot
    tokens = np.arange(12, dtype=np.int32) % by_id.config.vocab_size
    np.testing.assert_array_equal(np.asarray(pj.logits(by_id, tokens)), np.asarray(pj.logits(by_folder, tokens)))


def test_revision_and_local_files_only(home):
    snapshot = resolve_checkpoint(TINY)
    assert resolve_checkpoint(TINY, revision=COMMIT) == snapshot
    assert resolve_checkpoint(TINY, revision="main", local_files_only=True) == snapshot


@pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model")
def test_llm_and_tokenizer_by_repo_id():
    assert Tokenizer.from_folder(CODER).encode("def f(x):") == Tokenizer.from_folder(DEFAULT_MODEL).encode("def f(x):")
    with pj.LLM(CODER, max_batch_size=1, max_seq_len=64, prefill_chunk=32) as llm:
        out = llm.generate(["def fibonacci(n):"], pj.SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == llm.tokenizer.decode(out.token_ids)


def test_unknown_repo_or_revision_is_a_checkpoint_error(home):
    with pytest.raises(CheckpointError, match=r"(?s)'nobody/nothing'.*hf download nobody/nothing.*HF_HOME"):
        pj.load_model("nobody/nothing")
    with pytest.raises(CheckpointError, match=r"(?s)revision 'v9'.*--revision v9"):
        pj.load_model(TINY, revision="v9")
    with pytest.raises(CheckpointError, match="nobody/nothing"):
        Tokenizer.from_folder("nobody/nothing")


def test_paths_that_are_neither_folder_nor_id(hf_checkpoint, tmp_path):
    for name in ("./model", str(tmp_path / "missing"), "a/b/c", "/abs"):
        with pytest.raises(CheckpointError, match="not a checkpoint folder, nor a Hugging Face repo id"):
            pj.load_model(name)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "file").write_text("")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        resolve_checkpoint(tmp_path / "owner" / "file")
    with pytest.raises(ConfigError, match="revision"):
        resolve_checkpoint(hf_checkpoint("qwen3_gqa4_headdim"), revision="main")


def test_environment_variables_pick_the_cache(home):
    """A fresh process reads HF_HOME and HF_HUB_OFFLINE itself (no constants patched)."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    code = f"from pocketjax.model.hub import resolve_checkpoint; print(resolve_checkpoint({TINY!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == (home / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT).resolve()
