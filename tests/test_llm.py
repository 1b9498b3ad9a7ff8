"""LLM on the embedded model: text in, text out; greedy output equals an independent full-forward loop."""
import time

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.serve.llm import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model")
GREEDY = pj.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=4, max_seq_len=128, prefill_chunk=32) as llm:
        yield llm


def greedy_reference(model, prompt_ids, n, width=64):
    """Full causal forwards without cache; padded to one width (causal: the padding cannot change the logits
    at the positions read), so the loop compiles once."""
    ids = list(prompt_ids)
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(ids)] = ids
        ids.append(int(np.asarray(pj.logits(model, padded))[0, len(ids) - 1].argmax()))
    return ids[len(prompt_ids):]


def test_generate_strings_and_token_lists(llm):
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.token_ids == greedy_reference(llm.model, ids, 10)
        assert out.text == llm.tokenizer.decode(out.token_ids) and out.finish_reason == "length"
    again = llm.generate([llm.tokenizer.encode(prompts[0])], GREEDY)[0]
    assert again.token_ids == outs[0].token_ids


def test_stream_joins_to_generate_text(llm):
    text = "".join(llm.stream("def main():", GREEDY))
    assert text == llm.generate("def main():", GREEDY)[0].text


def test_chat_uses_the_template_and_stop_strings(llm):
    messages = [{"role": "user", "content": "print hello"}]
    reply = llm.chat(messages, GREEDY)
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\nprint hello<|im_end|>\n") and prompt.endswith("<|im_start|>assistant\n")
    assert reply.token_ids == llm.generate(prompt, GREEDY)[0].token_ids
    full = llm.generate("import os\n", pj.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].text
    stop = full[5:7]
    cut = llm.generate("import os\n", pj.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                       stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_errors_reach_the_caller(llm):
    with pytest.raises(pj.errors.SamplingError):
        llm.generate("x", pj.SamplingParams(top_p=2.0))
    with pytest.raises(pj.errors.RequestError):
        llm.generate([[llm.model.config.vocab_size]], GREEDY)
    for prompts in ([[1.5, 2]], [1.5, 2], [[1, "2"]]):  # never rounded or converted: a typed error
        with pytest.raises(pj.errors.RequestError, match="non-integer token id"):
            llm.generate(prompts, GREEDY)
    with pytest.raises(pj.errors.RequestError, match="a string or a list of token ids"):
        llm.generate([None], GREEDY)
    assert llm.generate("x", GREEDY)[0].finish_reason == "length"  # still serving


def test_generate_admits_its_prompts_as_one_batch(llm, monkeypatch):
    """generate queues every prompt before the loop can admit any (`Scheduler.submit_many`): however slowly the
    caller encodes them, the first prefill holds all of them, so the shapes compiled do not depend on the caller's
    speed (queued one at a time, the running loop prefilled the first prompt alone)."""
    encode, prefill, sizes = llm.encode, llm.engine.prefill_dispatch, []

    def slow_encode(prompt):
        time.sleep(0.2)  # the loop, already running, would have admitted the prompts queued so far
        return encode(prompt)

    def recorded_prefill(requests, **kwargs):
        sizes.append(len(requests))
        return prefill(requests, **kwargs)

    monkeypatch.setattr(llm, "encode", slow_encode)
    monkeypatch.setattr(llm.engine, "prefill_dispatch", recorded_prefill)
    outs = llm.generate(["def fibonacci(n):", "import os\n", "class Stack:"], GREEDY)
    assert sizes[0] == 3 and all(len(o.token_ids) == 10 for o in outs)
