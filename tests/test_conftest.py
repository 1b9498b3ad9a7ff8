"""The torch-free checkpoint builder (conftest.build_hf_checkpoint) against transformers' save_pretrained: the same
files, config.json, tensor names, shapes and dtypes, and transformers loads the folder as its own, every value
exactly. Runs where transformers is installed (CI's first leg); the second leg trusts these folders because of it."""
import json

import numpy as np
import pytest
from safetensors import safe_open

from conftest import TINY_CONFIGS, build_hf_checkpoint, build_hf_checkpoint_with_transformers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {**{name: {} for name in sorted(TINY_CONFIGS)},
         "bfloat16": dict(name="qwen3_gqa4_headdim", dtype="bfloat16"),
         "float16_sharded": dict(name="qwen2_mha_untied", dtype="float16", max_shard_size="20KB"),
         "override": dict(name="qwen3_kv1", vocab_size=300, max_position_embeddings=8192)}


def tensors(folder) -> dict[str, tuple]:
    """name -> (shape, safetensors dtype, file metadata) over every safetensors file in folder."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            out |= {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype(), f.metadata()) for k in f.keys()}
    return out


def without_version(path) -> dict:
    data = json.loads(path.read_text())
    data.pop("transformers_version", None)
    return data


@pytest.mark.parametrize("case", sorted(CASES))
def test_builder_writes_what_save_pretrained_writes(case, tmp_path):
    kwargs = {"name": case, **CASES[case]}
    ours = build_hf_checkpoint(tmp_path / "ours", **kwargs)
    theirs = build_hf_checkpoint_with_transformers(tmp_path / "theirs", **kwargs)
    assert without_version(ours / "config.json") == without_version(theirs / "config.json")
    assert without_version(ours / "generation_config.json") == without_version(theirs / "generation_config.json")
    assert tensors(ours) == tensors(theirs)
    sharded = "max_shard_size" in kwargs
    assert (ours / "model.safetensors.index.json").exists() == sharded == (theirs / "model.safetensors.index.json").exists()
    if sharded:
        index = [json.loads((f / "model.safetensors.index.json").read_text()) for f in (ours, theirs)]
        assert index[0]["metadata"] == index[1]["metadata"]
        assert sorted(index[0]["weight_map"]) == sorted(index[1]["weight_map"])
        assert len(set(index[0]["weight_map"].values())) > 1


@pytest.mark.parametrize("case", ["qwen3_gqa3_bias_tied", "qwen2_yarn", "bfloat16", "float16_sharded"])
def test_transformers_loads_every_value(case, tmp_path):
    kwargs = {"name": case, **CASES[case]}
    folder = build_hf_checkpoint(tmp_path / "ours", **kwargs)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype="auto")
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no error messages
    assert str(model.dtype) == f"torch.{kwargs.get('dtype', 'float32')}"
    state = model.state_dict()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                assert torch.equal(state[name], f.get_tensor(name)), name
    weights = [state[n].float().numpy() for n in state if n.endswith("proj.weight")]
    assert 0.06 < float(np.std(np.concatenate([w.ravel() for w in weights]))) < 0.10  # the stated N(0, 0.08)
