"""A trainer that donates its params (issue 67): `update_params` serves the caller's arrays as they are (no copy), so
a jitted training step with `donate_argnums` (the usual optax idiom) deletes the weights the engine serves. The next
engine step is then a ConfigError naming `update_params` (not JAX's "Array has been deleted"); nothing the engine
holds is lost, and serving resumes, the same bits, once `update_params` gives the step's new params."""
import jax
import jax.numpy as jnp
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.weights import deleted_leaf
from pocketjax.errors import ConfigError
from pocketjax.serve.llm import DEFAULT_MODEL

OPTIONS = dict(max_batch_size=2, max_seq_len=64, prefill_chunk=16)
PROMPT = [5, 17, 3, 99, 42, 7, 8, 250]


@jax.jit
def _copy(params):
    return jax.tree.map(jnp.copy, params)


# an optax-style update that donates its params: new arrays out, the ones passed in deleted
donating_step = jax.jit(lambda params: jax.tree.map(lambda x: x + jnp.zeros_like(x), params), donate_argnums=0)


@pytest.fixture(scope="module")
def model():
    return pj.load_model(DEFAULT_MODEL)


def greedy() -> pj.SamplingParams:
    return pj.SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)


def test_a_step_on_donated_params_is_refused_by_name_and_the_request_goes_on(model):
    engine = Engine(model, **OPTIONS)
    want = BatchedRequest(0, PROMPT, greedy())
    engine.allocate_slot(want)
    engine.batch_prefill([want])
    while not want.finished:
        engine.batch_decode_step([want])
    engine.free_slot(want.request_id)

    params = _copy(model.params)  # the trainer's arrays, served as they are
    engine.update_params(params)
    req = BatchedRequest(1, PROMPT, greedy())
    engine.allocate_slot(req)
    engine.batch_prefill([req])
    engine.batch_decode_step([req])
    new = donating_step(params)
    where = deleted_leaf(params)
    assert where is not None and deleted_leaf(new) is None
    with pytest.raises(ConfigError, match=r"update_params") as refused:
        engine.batch_decode_step([req])
    assert f"params{where} was deleted" in str(refused.value)
    engine.update_params(new)  # the step's new params: the request continues where it was
    while not req.finished:
        engine.batch_decode_step([req])
    assert (req.generated_tokens, req.logprobs) == (want.generated_tokens, want.logprobs)


def test_an_llm_fails_the_requests_by_name_then_serves_the_new_params(model):
    with pj.LLM(model, warmup=False, **OPTIONS) as llm:
        want = llm.generate([PROMPT], greedy())[0].token_ids
        params = _copy(model.params)
        llm.update_params(params)
        new = donating_step(params)
        with pytest.raises(ConfigError, match="update_params"):
            llm.generate([PROMPT], greedy())
        llm.update_params(new)
        assert llm.generate([PROMPT], greedy())[0].token_ids == want


def test_deleted_leaf_names_the_first_deleted_leaf():
    params = {"a": jnp.ones(2), "layers": [{"q": jnp.ones(3)}, {"q": jnp.ones(3)}]}
    assert deleted_leaf(params) is None
    params["layers"][1]["q"].delete()
    assert deleted_leaf(params) == "['layers'][1]['q']"
