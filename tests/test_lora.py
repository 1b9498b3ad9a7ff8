"""LoRA (model/lora.py, training/finetune.py): PEFT's adapters load and give transformers+PEFT's logits, ours open in
PEFT, merged equals unmerged, training lowers the loss, and the merged weights serve through LLM."""
import json

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.errors import CheckpointError, ConfigError, RequestError
from pocketjax.model.lora import LoraConfig, read_adapter, write_adapter
from pocketjax.nnx import Decoder

from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")
peft = oracle("peft")


CASES = {  # name: (checkpoint, PEFT LoraConfig keywords)
    "qv_down": ("qwen3_gqa4_headdim", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
    "all_rslora_pattern": ("qwen2_gqa2_tied", dict(r=2, lora_alpha=6, use_rslora=True, alpha_pattern={"down_proj": 3},
                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj", "down_proj"])),
}


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def peft_model(folder, adapter_dir=None, **lora_kwargs):
    """transformers' model with a PEFT adapter: loaded from adapter_dir, or fresh random (B != 0) per lora_kwargs."""
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if adapter_dir is not None:
        return peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.manual_seed(0)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    return peft.get_peft_model(base, config).eval()


def torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def peft_adapters(hf_checkpoint, tmp_path_factory):
    """case -> (checkpoint folder, adapter folder saved by PEFT, PEFT's logits, base logits, tokens)."""
    out = {}
    for case, (name, kwargs) in CASES.items():
        folder = hf_checkpoint(name)
        model = peft_model(folder, **kwargs)
        adapter_dir = tmp_path_factory.mktemp(f"peft_{case}")
        model.save_pretrained(adapter_dir)
        tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, size=(2, 19))
        with model.disable_adapter():
            base = torch_logits(model, tokens)
        out[case] = (folder, adapter_dir, torch_logits(model, tokens), base, tokens)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_adapter_gives_peft_logits(peft_adapters, case):
    folder, adapter_dir, ref, base, tokens = peft_adapters[case]
    assert rel_err(ref, base) > 1e-2  # the adapter changes the logits: the comparison below can fail
    merged = pj.load_model(folder, lora=adapter_dir)
    assert rel_err(pj.logits(merged, tokens), ref) <= 1e-5
    model = pj.load_model(folder)
    unmerged = Decoder(model, read_adapter(adapter_dir, model.config))
    assert rel_err(unmerged(tokens), ref) <= 1e-5
    assert rel_err(pj.logits(model, tokens), base) <= 1e-5  # the base weights are untouched


def test_load_model_merges_before_quantizing_and_sharding(peft_adapters, tmp_path):
    folder, adapter_dir, ref, _, tokens = peft_adapters["qv_down"]
    tp2 = pj.load_model(folder, lora=adapter_dir, tp=2)
    assert rel_err(pj.logits(tp2, tokens), ref) <= 1e-5
    assert not tp2.params["layers"][0]["q"].sharding.is_fully_replicated
    # reference: PEFT merges and saves a plain checkpoint, which pocketjax quantizes as it loads
    peft_model(folder, adapter_dir).merge_and_unload().save_pretrained(tmp_path)
    expected = pj.logits(pj.load_model(tmp_path, quantize="int8"), tokens)
    assert rel_err(pj.logits(pj.load_model(folder, lora=adapter_dir, quantize="int8"), tokens), expected) <= 1e-4


def test_our_adapter_opens_in_peft(hf_checkpoint, tmp_path):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    model = pj.load_model(folder)
    view = Decoder(model, LoraConfig(rank=3, alpha=5.0, targets=("k", "o", "gate", "up")))
    rng = np.random.default_rng(0)
    for pairs in view.lora:  # lora_B starts at zero; give it values so the test can fail
        for pair in pairs.values():
            pair.b.set_value(0.3 * rng.standard_normal(pair.b.get_value().shape).astype(np.float32))
    write_adapter(tmp_path, view.adapter(), base_model=str(folder))
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == [
        "k_proj", "o_proj", "gate_proj", "up_proj"]
    tokens = rng.integers(0, 301, size=(2, 11))
    ours = view(tokens)
    assert rel_err(ours, pj.logits(model, tokens)) > 1e-2
    assert rel_err(ours, torch_logits(peft_model(folder, tmp_path), tokens)) <= 1e-5


@pytest.mark.parametrize("scan_layers", [False, True])
def test_merged_equals_unmerged(hf_checkpoint, scan_layers):
    model = pj.load_model(hf_checkpoint("qwen3_kv1"), scan_layers=scan_layers)
    view = Decoder(model, LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down")))
    rng = np.random.default_rng(1)
    for pairs in view.lora:
        for pair in pairs.values():
            pair.b.set_value(0.3 * rng.standard_normal(pair.b.get_value().shape).astype(np.float32))
    tokens = rng.integers(0, 280, size=(2, 13))
    unmerged = view(tokens)
    merged_model = view.to_model()
    assert isinstance(merged_model.params["layers"], dict) == scan_layers
    assert rel_err(pj.logits(merged_model, tokens), unmerged) <= 1e-5
    assert rel_err(unmerged, pj.logits(model, tokens)) > 1e-2


def test_merge_into_quantized_weight_is_refused(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen3_kv1"), quantize="int8")
    view = Decoder(model, LoraConfig(rank=2, targets=("q",)))
    assert view(np.arange(8)[None]).shape == (1, 8, 280)  # unmerged over a quantized base runs (QLoRA)
    with pytest.raises(ConfigError, match="quantized"):
        view.to_model()


@pytest.fixture(scope="module")
def our_adapter(hf_checkpoint, tmp_path_factory):
    """(checkpoint folder, an adapter folder for it that write_adapter saved): torch-free, unlike peft_adapters, so
    the error tests that need an adapter but no reference run in CI's second leg too."""
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    view = Decoder(pj.load_model(folder), LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down")))
    return folder, write_adapter(tmp_path_factory.mktemp("ours_qv_down"), view.adapter(), base_model=str(folder))


def test_bad_adapters_raise_typed_errors(our_adapter, hf_checkpoint, tmp_path):
    folder, adapter_dir = our_adapter
    with pytest.raises(CheckpointError, match="not a PEFT adapter"):
        pj.load_model(folder, lora=tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "use_dora": True}))
    with pytest.raises(ConfigError, match="use_dora"):
        pj.load_model(folder, lora=tmp_path)
    with pytest.raises(CheckpointError, match="do not fit"):  # another architecture's adapter
        pj.load_model(hf_checkpoint("qwen3_kv1"), lora=adapter_dir)
    for bad in (dict(rank=0), dict(alpha=-1.0), dict(targets=("q", "lm_head")), dict(targets=())):
        with pytest.raises(ConfigError):
            LoraConfig(**bad)


def test_finetune_lowers_the_loss_and_serves_merged(hf_checkpoint):
    from pocketjax.training.finetune import finetune, token_windows
    from pocketjax.training.evaluation import evaluate
    from pocketjax.training.train import greedy

    model = pj.load_model(hf_checkpoint("qwen3_kv1"))
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(2, 280, 12)) * 6 for _ in range(8)]  # repeated phrases: learnable in a few steps
    view, history = finetune(model, docs, LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "up")), steps=24,
                             lr=1e-2, warmup=2, batch_size=4, seq_len=16, log_every=8, log=None)
    rows = token_windows(model, docs, 16)
    before = evaluate(model.params, model.config, rows, 4)
    after = evaluate(view.functional(), model.config, rows, 4)
    assert after < before - 0.5, (before, after, history)
    assert view.params["layers"][0]["q"].get_value() is model.params["layers"][0]["q"]  # the base stayed frozen
    merged = view.to_model()
    prompt = docs[0][:12]
    expected = greedy(merged.params, model.config, prompt, 6, bucket=32)
    with pj.LLM(merged, max_batch_size=2, max_seq_len=64) as llm:
        out = llm.generate([prompt], pj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == expected


def test_finetune_cli_writes_an_adapter_load_model_reads(tmp_path):
    from pocketjax.serve import cli
    from pocketjax.serve.llm import DEFAULT_MODEL
    from pocketjax.training.finetune import finetune

    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    out = tmp_path / "adapter"
    assert cli.main(["finetune", "--data", str(data), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                     "--rank", "2", "--alpha", "4", "--targets", "q,v", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = pj.load_model(DEFAULT_MODEL, lora=out)
    assert model.params["layers"][0]["q"].shape == (256, 256)
    with pytest.raises(RequestError, match="not a file"):
        finetune(model, str(tmp_path / "missing.txt"))
