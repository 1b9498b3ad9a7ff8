"""Issue 68, item 3: the engine's features that touch the forward hold on a mixture-of-experts model as on a dense one:
hooks and steering (against transformers' forward hook on the same checkpoint), captured activations, and
structured outputs (valid under the grammar, an unconstrained batch mate bitwise as alone)."""
import re
from dataclasses import replace

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine

from conftest import MissingOracle, oracle
from test_engine import random_prompts, run
from test_engine_hooks import GREEDY, reference, steer_at, steering
from test_structured import EOS, byte_tokenizer, served, text

torch = oracle("torch")
transformers = oracle("transformers")
NAME = "qwen2_moe"  # shared expert, a dense layer among sparse ones (mlp_only_layers), 3 experts of 8 per token
LAYER = 1  # the dense layer: the hook sits between a sparse layer and a dense one


@pytest.fixture(scope="module")
def moe(moe_checkpoint):
    folder = moe_checkpoint(NAME, eos_token_id=EOS)
    return folder, pj.load_model(folder)


def test_a_hook_on_a_moe_model_equals_transformers_forward_hook_and_steering_is_the_hook(moe):
    """pj.logits(hook=) adds a vector after a layer as a torch forward hook does on Qwen2MoeForCausalLM (within 1e-5);
    the engine's steer= is that hook as data (tokens and logprobs ==), greedy equals the cache-free reference, an
    unsteered batch mate is bitwise as alone, and captured activations equal pj.logits' hidden states."""
    folder, model = moe
    steer = steering(model, 3, LAYER)
    tokens = np.asarray([random_prompts(2, (9,), model.config.vocab_size)[0]], np.int32)
    hooked, hidden = pj.logits(model, tokens, hook=steer_at(LAYER, steer[LAYER]), return_hidden=True)
    if not isinstance(transformers, MissingOracle):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        add = lambda module, args, out: (out[0] + torch.from_numpy(steer[LAYER]),) + tuple(out[1:]) \
            if isinstance(out, tuple) else out + torch.from_numpy(steer[LAYER])
        handle = hf.model.layers[LAYER].register_forward_hook(add)
        with torch.no_grad():
            ref = hf(torch.tensor(tokens)).logits.numpy()
        handle.remove()
        assert np.max(np.abs(np.asarray(hooked) - ref)) / np.max(np.abs(ref)) <= 1e-5
    sp = replace(GREEDY, logprobs=2)
    steered_sp, hooked_sp = replace(sp, steer=steer), replace(sp, hook=steer_at(LAYER, steer[LAYER]))
    p0, p1 = random_prompts(1, (7, 12), model.config.vocab_size)
    engine = Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16)
    (steered,) = run(engine, [p0], steered_sp)
    (by_hook,) = run(engine, [p0], hooked_sp)
    assert steered.generated_tokens == by_hook.generated_tokens == reference(model, p0, GREEDY.max_tokens,
                                                                             hooked_sp.hook)
    assert steered.logprobs == by_hook.logprobs
    mixed = run(engine, [p0, p1], [steered_sp, sp])
    (alone,) = run(engine, [p1], sp)
    assert mixed[0].generated_tokens == steered.generated_tokens and mixed[0].logprobs == steered.logprobs
    assert mixed[1].generated_tokens == alone.generated_tokens and mixed[1].logprobs == alone.logprobs
    assert run(engine, [p0], sp)[0].generated_tokens != steered.generated_tokens  # the steering matters
    layers = (0, LAYER + 1, model.config.num_layers)
    with pj.LLM(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16) as llm:
        out = llm.generate([list(tokens[0])], replace(steered_sp, return_hidden=layers))[0]
    expected = np.asarray(hidden)[list(layers), 0, tokens.shape[1] - 1]
    np.testing.assert_allclose(out.hidden[0], expected, rtol=1e-4, atol=1e-4)


def test_structured_outputs_on_a_moe_model_validate_and_leave_batch_mates_as_alone(moe):
    _, model = moe
    engine = pj.Engine(model, tokenizer=byte_tokenizer(), max_batch_size=2, max_seq_len=32, prefill_chunk=16)
    pattern = r"[ab]{2}-[0-9]{1,3}"
    constrained = pj.SamplingParams(max_tokens=14, temperature=1.0, seed=9, structured=pj.Structured(regex=pattern))
    plain = ([7, 8, 9], pj.SamplingParams(max_tokens=14, temperature=0.0, logprobs=3, ignore_eos=True))
    alone = served(engine, [plain])[0].result()
    mixed, mate = (h.result() for h in served(engine, [plain, ([12, 13], constrained)]))
    assert mate.finish_reason == "stop" and re.fullmatch(pattern, text(byte_tokenizer(), mate.token_ids))
    assert mixed.token_ids == alone.token_ids
