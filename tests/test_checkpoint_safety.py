"""A malicious checkpoint: files named outside its folder, values that would hang or poison the model, and every
malformed shape of config.json, generation_config.json, the shard index, the safetensors header and
tokenizer_config.json. Each is refused with the documented CheckpointError / ConfigError before any work, and an
audit hook on `open` proves nothing outside the folder was read (the Hub cache's snapshot -> blob links still load).
"""
import contextlib
import json
import math
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.errors import CheckpointError, ConfigError
from pocketjax.model.checkpoint import SafetensorsFile, open_checkpoint, write_safetensors
from pocketjax.model.config import ModelConfig
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.tokenizer import Tokenizer

OPENED: list[str] = []
AUDITING = [False]


def _audit(event, args):
    if event == "open" and AUDITING[0] and args and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # (audit hooks cannot be removed: it records only while AUDITING)


@contextlib.contextmanager
def audited():
    """The paths opened inside the block."""
    OPENED.clear()
    AUDITING[0] = True
    try:
        yield OPENED
    finally:
        AUDITING[0] = False


@pytest.fixture(scope="module")
def source(hf_checkpoint):
    return hf_checkpoint("qwen3_gqa4_headdim")


def copy(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file():
            shutil.copy(file, folder / file.name)
    return folder


def sharded(source: Path, folder: Path, **moved: str) -> Path:
    """`source` as a one-shard checkpoint with an index; `moved` sends tensors (by name) to other file names."""
    copy(source, folder)
    (folder / "model.safetensors").rename(folder / "shard-1.safetensors")
    names = SafetensorsFile(folder / "shard-1.safetensors").keys()
    weight_map = {name: "shard-1.safetensors" for name in names}
    for name, target in moved.items():
        weight_map[name.replace("__", ".")] = target
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


# ---- files outside the folder -----------------------------------------------------------------------------------------
def test_a_sharded_checkpoint_loads(source, tmp_path):
    model = pj.load_model(sharded(source, tmp_path / "ok"))
    reference = pj.load_model(source)
    tokens = [[1, 2, 3, 4]]
    np.testing.assert_array_equal(pj.logits(model, tokens), pj.logits(reference, tokens))


@pytest.mark.parametrize("target", ["../../../../../../../../etc/passwd", "/etc/passwd", "../other/model.safetensors",
                                    "sub/../../other/model.safetensors"])
def test_an_index_naming_files_outside_is_refused(source, tmp_path, target):
    copy(source, tmp_path / "other")  # another model's valid file, one folder up
    folder = sharded(source, tmp_path / "evil", model__norm__weight=target)
    with audited() as audit, pytest.raises(CheckpointError, match="outside the checkpoint folder") as error:
        open_checkpoint(folder)
    assert "root:" not in str(error.value)  # nothing of the outside file is echoed
    assert not any("passwd" in p or "/other/" in p for p in audit)


def test_symlinks_out_of_the_folder_are_refused(source, tmp_path):
    other = copy(source, tmp_path / "other")
    folder = copy(source, tmp_path / "linked")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(other / "model.safetensors")
    with audited() as audit, pytest.raises(CheckpointError, match="outside"):
        pj.load_model(folder)
    assert not [p for p in audit if "/other/" in p]
    (folder / "model.safetensors").unlink()
    shutil.copy(other / "model.safetensors", folder / "model.safetensors")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(other / "config.json")
    with audited() as audit, pytest.raises(CheckpointError, match="outside"):
        pj.load_model(folder)
    assert not [p for p in audit if "/other/" in p]


def test_hub_cache_snapshot_links_to_its_blobs_load(source, tmp_path):
    repo = tmp_path / "hub" / "models--evil--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in source.iterdir():
        if file.is_file():
            shutil.copy(file, blobs / ("blob-" + file.name))
            (snapshot / file.name).symlink_to(Path("../../blobs") / ("blob-" + file.name))
    model = pj.load_model(snapshot)
    np.testing.assert_array_equal(pj.logits(model, [[5, 6]]), pj.logits(pj.load_model(source), [[5, 6]]))
    # a link out of the cache's blob store is refused even there
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(source / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside"):
        pj.load_model(snapshot)


# ---- config values ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    {"num_hidden_layers": 10**9}, {"num_hidden_layers": True}, {"hidden_size": "64"}, {"vocab_size": 0},
    {"vocab_size": 2**40}, {"rms_norm_eps": math.nan}, {"rms_norm_eps": math.inf}, {"rms_norm_eps": -1e-6},
    {"rope_theta": math.inf}, {"rope_theta": math.nan}, {"rope_theta": "1e4"}, {"rope_theta": 10**400},
    {"head_dim": 3}, {"head_dim": 16.0}, {"num_key_value_heads": 0}, {"num_key_value_heads": 3},
    {"eos_token_id": 10**6}, {"eos_token_id": "2"}, {"eos_token_id": [1, None]}, {"bos_token_id": -1},
    {"tie_word_embeddings": "yes"}, {"attention_bias": 1}, {"max_position_embeddings": 2**40},
    {"rope_scaling": {"rope_type": "yarn", "factor": math.inf}}, {"rope_scaling": {"rope_type": "yarn", "factor": 4,
                                                                                    "beta_fast": math.nan}},
    {"rope_scaling": {"rope_type": ["x"]}}, {"rope_scaling": [1]}, {"model_type": ["qwen3"]},
    {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": True}},
])
def test_config_values_are_checked(source, overrides):
    cfg = {**json.loads((source / "config.json").read_text()), **overrides}
    with pytest.raises(ConfigError):
        ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("text", ["[1, 2]", "null", "{", "[" * 100_000 + "]" * 100_000, '"config"', "\xff"])
def test_a_malformed_config_file_is_a_config_error(source, tmp_path, text):
    folder = copy(source, tmp_path / "cfg")
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError):
        pj.load_model(folder)


@pytest.mark.parametrize("value", ['{"eos_token_id": "x"}', '{"eos_token_id": 99999}', "[]", "{"])
def test_generation_config_is_checked(source, tmp_path, value):
    folder = copy(source, tmp_path / "gen")
    (folder / "generation_config.json").write_text(value)
    model = pj.load_model(folder)
    with pytest.raises(ConfigError):
        Engine(model, max_batch_size=1, max_seq_len=32)


@pytest.mark.parametrize("name, dtype", [("model.layers.0.self_attn.q_proj.weight", np.int32),
                                         ("model.embed_tokens.weight", np.int8), ("model.norm.weight", np.bool_),
                                         ("model.layers.0.mlp.up_proj.weight", np.uint8)])
def test_an_integer_weight_is_refused(source, tmp_path, name, dtype):
    """A weight stored as I32, I8, U8 or BOOL holds values of no float kind: loading it (cast to float, which the
    loader did) would serve garbage without a word. CheckpointError names the tensor and its dtype."""
    folder = copy(source, tmp_path / "int")
    file = SafetensorsFile(folder / "model.safetensors")
    tensors = {key: np.array(file.tensor(key)) for key in file.keys()}
    tensors[name] = np.ones(tensors[name].shape, dtype)
    del file
    write_safetensors(folder / "model.safetensors", tensors)
    stored = {np.int32: "I32", np.int8: "I8", np.bool_: "BOOL", np.uint8: "U8"}[dtype]
    with pytest.raises(CheckpointError, match=f"{name}.*{stored}"):
        pj.load_model(folder)


# ---- the safetensors header and the index -----------------------------------------------------------------------------
def write_raw(path: Path, header, data: bytes = b"\0" * 64) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.mark.parametrize("header", [
    [1, 2],
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "u": {"dtype": "F32", "shape": [2],
                                                                         "data_offsets": [4, 12]}},  # overlap
    {"t": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, -8]}},
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 16]}},
    {"t": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}},
    {"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}},
    {"t": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}},  # past the end of the file
    {"t": "F32"},
    {"__metadata__": {"format": 1}},
    {"__metadata__": "pt"},
])
def test_malformed_safetensors_headers(tmp_path, header):
    with pytest.raises(CheckpointError):
        SafetensorsFile(write_raw(tmp_path / "x.safetensors", header))


def test_deeply_nested_header_and_index(tmp_path):
    with pytest.raises(CheckpointError):
        SafetensorsFile(write_raw(tmp_path / "x.safetensors", b"[" * 200_000 + b"]" * 200_000))
    write_safetensors(tmp_path / "model.safetensors", {"a": np.zeros(2, np.float32)})
    for index in ("[" * 200_000 + "]" * 200_000, "[]", '{"weight_map": []}', '{"weight_map": {"a": 1}}',
                  '{"weight_map": {}}', '{"metadata": {}}'):
        (tmp_path / "model.safetensors.index.json").write_text(index)
        with pytest.raises(CheckpointError):
            open_checkpoint(tmp_path)


# ---- tokenizer_config.json -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [
    [1], {"added_tokens_decoder": {"x": {"content": "a"}}}, {"added_tokens_decoder": {"5": "a"}},
    {"added_tokens_decoder": {"5": {"content": 7}}}, {"chat_template": 5}, {"chat_template": [{"template": "x"}]},
    {"chat_template": {"default": 1}}, {"additional_special_tokens": 5}, {"eos_token": ["x"]},
])
def test_malformed_tokenizer_config(tmp_path, config):
    if not (DEFAULT_MODEL / "tokenizer.json").exists():
        pytest.skip("no embedded model")
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError):
        Tokenizer.from_folder(tmp_path)


def test_tokenizer_files_stay_inside(tmp_path):
    if not (DEFAULT_MODEL / "tokenizer.json").exists():
        pytest.skip("no embedded model")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").symlink_to(DEFAULT_MODEL / "tokenizer.json")
    with audited() as audit, pytest.raises(CheckpointError, match="outside"):
        Tokenizer.from_folder(tmp_path / "tok")
    assert not [p for p in audit if p.startswith(str(DEFAULT_MODEL))]
    (tmp_path / "tok" / "tokenizer.json").unlink()
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "chat_template.jinja").symlink_to("/etc/hostname")
    with audited() as audit, pytest.raises(CheckpointError, match="outside"):
        Tokenizer.from_folder(tmp_path / "tok")
    assert not [p for p in audit if p.startswith("/etc/")]
