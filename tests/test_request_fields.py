"""Every request field accounted for (issue 44): unknown fields are a 400 naming them, harmless ones pass and change
nothing, and each implemented vLLM extra (serve/http/openai_protocol.py `VllmFields`, engine/processors.py) is checked
with the official openai client against an independent reference: the request without the field, the tokenizer,
log_softmax(pj.logits), or the same request run alone (bitwise)."""
from dataclasses import replace

import jax
import numpy as np
import openai
import pytest

import pocketjax as pj
from pocketjax.engine.processors import bad_word_ids
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.errors import SamplingError
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.api_error import APIError
from pocketjax.serve.http.openai_protocol import ChatCompletionRequest

from conftest import served
from test_tokenization import call as post

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model")
SLOTS, CONTEXT = 4, 128  # test_server's engine shape: a shared session reuses its compiled steps
NAME = "pocket-coder"
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=SLOTS, max_seq_len=CONTEXT, prefill_chunk=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with served(llm) as (server, client):
        yield server, client


@pytest.fixture(scope="module")
def client(server):
    return server[1]


def chat(client, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("max_tokens", "temperature", "stop", "logit_bias",
                                                                 "seed", "metadata", "store", "service_tier", "user")}
    return client.chat.completions.create(model=NAME, messages=fields.pop("messages", CHAT),
                                          **{"max_tokens": 16, "temperature": 0, **fields}, extra_body=extra)


def complete(client, prompt=PROMPT, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("max_tokens", "temperature", "stop", "logit_bias",
                                                                 "seed", "user", "echo", "logprobs")}
    return client.completions.create(model=NAME, prompt=prompt, **{"max_tokens": 12, "temperature": 0, **fields},
                                     extra_body=extra)


def token_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


# ---- the three groups ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [chat, complete], ids=["chat", "completions"])
def test_an_unknown_field_is_a_400_naming_it(client, call):
    with pytest.raises(openai.BadRequestError) as caught:
        call(client, frobnicate_logits=2.0)
    assert caught.value.param == "frobnicate_logits"
    with pytest.raises(openai.BadRequestError) as caught:  # implemented elsewhere, not here: refused by name
        call(client, use_beam_search=True)
    assert caught.value.param == "use_beam_search"


def test_tokenize_and_detokenize_refuse_unknown_fields(server):
    url = server[0].url
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        assert post(url + route, body)[0] == 200
        status, answer = post(url + route, {**body, "frobnicate": 1})
        assert status == 400 and answer["error"]["param"] == "frobnicate"


@pytest.mark.parametrize("call", [chat, complete], ids=["chat", "completions"])
def test_harmless_fields_pass_and_change_nothing(client, call):
    harmless = dict(user="u1", priority=0, request_id="r1", store=False, prompt_cache_key="k",
                    safety_identifier="s", prediction={"type": "content", "content": "x"})
    if call is chat:
        harmless.update(metadata={"team": "a"}, service_tier="auto", modalities=["text"])
    plain, given = call(client), call(client, **harmless)
    assert _text(given) == _text(plain)


def _text(answer) -> str:
    choice = answer.choices[0]
    return choice.message.content if hasattr(choice, "message") else choice.text


# ---- implemented fields ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [chat, complete], ids=["chat", "completions"])
def test_logit_bias_plus_100_makes_every_greedy_token_that_one(llm, client, call):
    target = token_ids(llm, " sum")[0]
    answer = call(client, logit_bias={str(target): 100}, max_tokens=6, logprobs=True if call is chat else 1,
                  return_tokens_as_token_ids=True)
    logprobs = answer.choices[0].logprobs
    names = [t.token for t in logprobs.content] if call is chat else logprobs.tokens
    assert names == [f"token_id:{target}"] * 6
    with pytest.raises(openai.BadRequestError) as caught:
        call(client, logit_bias={"not-an-id": 1})
    assert caught.value.param == "logit_bias"


def test_allowed_token_ids_are_the_only_tokens_sampled(llm, client):
    allowed = [token_ids(llm, w)[0] for w in (" a", " b", " c", "\n")]
    answer = complete(client, allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=10, logprobs=1,
                      return_tokens_as_token_ids=True)
    sampled = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
    assert len(sampled) == 10 and set(sampled) <= set(allowed)


def test_bad_words_never_appear(llm, client):
    """A word of several tokens loses its last token once the others end the output (vLLM's rule): banning the
    greedy answer's first two tokens as one word keeps the first and replaces the second."""
    plain = complete(client, max_tokens=8, logprobs=1, return_tokens_as_token_ids=True)
    greedy = [int(t.removeprefix("token_id:")) for t in plain.choices[0].logprobs.tokens]
    word = llm.tokenizer.decode(greedy[:2])
    banned = bad_word_ids(llm.tokenizer, [word])
    assert tuple(greedy[:2]) in banned
    answer = complete(client, bad_words=[word], max_tokens=8, logprobs=1, return_tokens_as_token_ids=True)
    sampled = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
    for ids in banned:
        assert not any(tuple(sampled[i:i + len(ids)]) == ids for i in range(len(sampled))), (ids, sampled)
    assert sampled[0] == greedy[0] and sampled[1] != greedy[1]


def test_min_tokens_holds_back_eos_and_stop_strings(llm, client):
    """+100 on EOS (or a stop token id) ends the reply at its first token; with min_tokens it ends right after."""
    eos = min(llm.engine.eos_ids)
    other = token_ids(llm, " sum")[0]
    for fields in (dict(logit_bias={str(eos): 100}), dict(logit_bias={str(other): 100}, stop_token_ids=[other])):
        forced = chat(client, **fields)
        assert forced.usage.completion_tokens == 1 and forced.choices[0].finish_reason == "stop"
        held = chat(client, min_tokens=5, **fields)
        assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    plain = chat(client)
    first = plain.choices[0].message.content.split()[0]  # a stop string in the first tokens is not looked for
    assert chat(client, max_tokens=8, stop=[first]).choices[0].message.content == ""
    assert chat(client, max_tokens=8, stop=[first], min_tokens=8).choices[0].message.content.startswith(first)


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    text = complete(client, max_tokens=16).choices[0].text
    stop = text.strip().split()[1]
    cut = complete(client, max_tokens=16, stop=[stop]).choices[0].text
    kept = complete(client, max_tokens=16, stop=[stop], include_stop_str_in_output=True).choices[0].text
    assert kept == cut + stop and not cut.endswith(stop)


def test_skip_special_tokens_false_shows_special_tokens(llm, client):
    special = llm.tokenizer.encode("<|im_start|>")
    assert len(special) == 1
    bias = {str(special[0]): 100}
    assert complete(client, logit_bias=bias, max_tokens=3).choices[0].text == ""
    shown = complete(client, logit_bias=bias, max_tokens=3, skip_special_tokens=False).choices[0].text
    assert shown == "<|im_start|>" * 3


def test_truncate_prompt_tokens_equals_sending_the_truncated_prompt(llm, client):
    ids = token_ids(llm, PROMPT + "\n    # add two numbers and return the result\n")
    cut = complete(client, prompt=ids, truncate_prompt_tokens=6, max_tokens=8)
    alone = complete(client, prompt=ids[-6:], max_tokens=8)
    assert cut.choices[0].text == alone.choices[0].text and cut.usage.prompt_tokens == 6
    chat_cut = chat(client, truncate_prompt_tokens=5, max_tokens=8)
    rendered = post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize", {"messages": CHAT})[1]
    assert chat_cut.usage.prompt_tokens == 5
    assert chat_cut.choices[0].message.content == complete(client, prompt=rendered["tokens"][-5:],
                                                           max_tokens=8).choices[0].text


@pytest.mark.parametrize("call", [chat, complete], ids=["chat", "completions"])
def test_prompt_logprobs_match_log_softmax_of_pj_logits(llm, client, call):
    answer = call(client, prompt_logprobs=2, max_tokens=1, return_tokens_as_token_ids=True)
    data = answer.model_dump()
    given = data["prompt_logprobs"] if call is chat else data["choices"][0]["prompt_logprobs"]
    if call is chat:
        prompt = post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize", {"messages": CHAT})[1]["tokens"]
    else:
        prompt = token_ids(llm, PROMPT)
    assert len(given) == len(prompt) and given[0] is None
    reference = np.asarray(jax.nn.log_softmax(pj.logits(llm.model, np.array([prompt], np.int32))[0], axis=-1))
    for t in range(1, len(prompt)):
        entry = given[t]
        assert str(prompt[t]) in entry and len(entry) <= 3
        for token, item in entry.items():
            assert abs(item["logprob"] - reference[t - 1, int(token)]) < 2e-4, (t, token)
        best = sorted(entry.items(), key=lambda kv: -kv[1]["logprob"])
        assert int(best[0][0]) == int(np.argmax(reference[t - 1])) and best[0][1]["rank"] == 1


def test_continue_final_message_and_echo_on_chat(client):
    start = "def add(a, b):"
    messages = CHAT + [{"role": "assistant", "content": start}]
    answer = chat(client, messages=messages, add_generation_prompt=False, continue_final_message=True, echo=True)
    plain = chat(client, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert answer.choices[0].message.content == start + plain.choices[0].message.content
    assert chat(client, echo=True).choices[0].message.content == chat(client).choices[0].message.content  # user last
    streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True,
                                              extra_body=dict(add_generation_prompt=False,
                                                              continue_final_message=True, echo=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages=messages, add_generation_prompt=True, continue_final_message=True)
    assert caught.value.param == "continue_final_message"


def test_chat_template_needs_trust_and_reasoning_effort_needs_a_thinking_template(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, chat_template="{{ 'x' }}")
    assert caught.value.param == "chat_template"
    with pytest.raises(openai.BadRequestError) as caught:  # pocket-coder's template has no enable_thinking
        chat(client, reasoning_effort="low")
    assert caught.value.param == "reasoning_effort"
    template = "{% if enable_thinking %}think{% else %}answer{% endif %}"
    body = ChatCompletionRequest(messages=CHAT, reasoning_effort="low", chat_template=template)
    assert body.template_options(True, {"default": "{{ 'x' }}"})["enable_thinking"] is False
    body = ChatCompletionRequest(messages=CHAT, reasoning_effort="high")
    assert body.template_options(False, {"default": template})["enable_thinking"] is True
    with pytest.raises(APIError):
        ChatCompletionRequest(messages=CHAT, reasoning_effort="huge").check_supported()


# ---- the engine: data, not programs ----------------------------------------------------------------------------

def test_limits_compile_nothing_new_and_leave_other_rows_bitwise_alone(llm):
    """After one request of each kind, requests with other biases, ids, words and min_tokens add no program; a
    limited row beside plain ones leaves their tokens and logprobs bit for bit what they are alone."""
    plain = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
             SamplingParams(max_tokens=6, temperature=0.8, seed=5, top_k=20, logprobs=2)]
    limited = [SamplingParams(max_tokens=6, temperature=0.0, logit_bias={7: 5.0, 9: -3.0}),
               SamplingParams(max_tokens=6, temperature=0.7, seed=2, allowed_token_ids=[5, 6, 7, 8]),
               SamplingParams(max_tokens=6, temperature=0.0, bad_words=["return"], min_tokens=4)]
    llm.generate([PROMPT] * 3, limited)  # the first of each: may compile the masked sampler
    before = llm.engine.compiled_count()
    again = [SamplingParams(max_tokens=6, temperature=0.0, logit_bias={11: 50.0}),
             SamplingParams(max_tokens=6, temperature=0.7, seed=9, allowed_token_ids=[1, 2, 3]),
             SamplingParams(max_tokens=6, temperature=0.0, bad_words=["a b", "x"], min_tokens=2)]
    llm.generate([PROMPT] * 3, again)
    assert llm.engine.compiled_count() == before
    alone = [llm.generate(PROMPT, p)[0] for p in plain]
    other = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={13: 50.0})
    mixed = llm.generate([PROMPT, "import os", PROMPT, "x = 1"], [plain[0], again[0], plain[1], other])
    for a, m in zip(alone, (mixed[0], mixed[2])):
        assert a.token_ids == m.token_ids and a.logprobs == m.logprobs
    assert mixed[1].token_ids == [11] * 6 and mixed[3].token_ids == [13] * 6  # each row its own bias
    assert set(llm.generate("x = 1", again[1])[0].token_ids) <= {1, 2, 3}


def test_sampling_params_name_a_bad_field():
    for bad, field in ((dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logit_bias={1: 101}), "logit_bias"),
                       (dict(logit_bias={10**9: 1}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
                       (dict(bad_words=[" "]), "bad_words"), (dict(skip_special_tokens=1), "skip_special_tokens")):
        with pytest.raises(SamplingError, match=f"SamplingParams.{field}"):
            SamplingParams(**bad).validate(4096)


def test_steer_equals_the_engine_steered_and_a_bad_one_is_a_400(llm, client):
    """The server's `steer` extra is SamplingParams.steer: its tokens equal LLM.generate's with the same vectors, which
    differ from the unsteered ones; a layer the model lacks is a 400 naming the field."""
    c = llm.engine.model.config
    vector = np.random.default_rng(0).normal(0, 4.0, c.hidden_size).astype(np.float32)
    answer = complete(client, steer={"1": vector.tolist()}, max_tokens=8, logprobs=1, return_tokens_as_token_ids=True)
    served_ids = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    steered = llm.generate([PROMPT], replace(sp, steer={1: vector}))[0].token_ids
    assert served_ids == steered != llm.generate([PROMPT], sp)[0].token_ids
    with pytest.raises(openai.BadRequestError, match="steer"):
        complete(client, steer={str(c.num_layers): vector.tolist()})
