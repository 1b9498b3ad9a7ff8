"""Checkpoint loading: every broken-checkpoint case raises CheckpointError naming the tensor or file."""
import json
import shutil

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.model.checkpoint import SafetensorsFile, write_safetensors
from pocketjax.errors import CheckpointError


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("qwen2_mha_untied"), folder)
    return folder


def rewrite(folder, edit):
    f = SafetensorsFile(folder / "model.safetensors")
    tensors = {k: np.array(f.tensor(k)) for k in f.keys()}
    del f
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        pj.load_model(ckpt)


def test_unexpected_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected .*model\.layers\.0\.extra\.weight"):
        pj.load_model(ckpt)


def test_wrong_shape(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape"):
        pj.load_model(ckpt)


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        pj.load_model(ckpt)


@pytest.mark.parametrize("blob", [b"", b"\x05\x00", (10**9).to_bytes(8, "little") + b"{}",
                                  (7).to_bytes(8, "little") + b"{oops!}"])
def test_corrupt_header(ckpt, blob):
    (ckpt / "model.safetensors").write_bytes(blob)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        pj.load_model(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        pj.load_model(ckpt)


def test_sharded_index_names_missing_file_tensor(hf_checkpoint, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(hf_checkpoint("qwen2_mha_untied", max_shard_size="20KB"), folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"], = [f for f in set(index["weight_map"].values())
                                                 if f != index["weight_map"]["model.norm.weight"]][:1]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        pj.load_model(folder)


def test_dtype_cast_and_roundtrip_bf16(tmp_path):
    import ml_dtypes
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
              "b": np.array([1, -2], np.int64)}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.tensor("a").dtype == ml_dtypes.bfloat16 and f.tensor("a").shape == (2, 3)
    np.testing.assert_array_equal(f.tensor("a").astype(np.float32), arrays["a"].astype(np.float32))
    np.testing.assert_array_equal(f.tensor("b"), arrays["b"])


def test_load_casts_to_requested_dtype(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen2_mha_untied"), dtype="float16")
    assert model.params["layers"][0]["q"].dtype == np.float16
    with pytest.raises(pj.errors.ConfigError, match="dtype"):
        pj.load_model(hf_checkpoint("qwen2_mha_untied"), dtype="int8")
