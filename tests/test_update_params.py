"""Live weight updates (`LLM.update_params` / `Engine.update_params`): an RL loop's new policy served without a new
engine, a new cache or a recompile. The reference is a fresh LLM built on the same new weights: after an update the
engine's outputs equal it bit for bit (tokens and logprobs; the CPU default is batch invariant)."""
from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.errors import ConfigError
from pocketjax.serve.llm import DEFAULT_MODEL

OPTIONS = dict(max_batch_size=4, max_seq_len=128, prefill_chunk=32)
PROMPTS = ["def add(a, b):\n    return", "import numpy as np\n", "class Stack:\n    def push(self, x):"]


def greedy(n: int = 12) -> pj.SamplingParams:
    return pj.SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True)


def outputs(llm: pj.LLM, sampling: pj.SamplingParams | None = None) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, [lp for lp, _ in c.logprobs]) for c in llm.generate(PROMPTS, sampling or greedy())]


def nudged(params, seed: int, scale: float = 0.05):
    """Other weights of the same tree, shapes and dtypes (every floating leaf moved by a relative `scale`)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [x * (1 + scale * jax.random.normal(k, x.shape, x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x
           for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, out)


@pytest.fixture(scope="module")
def model():
    return pj.load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def new_params(model):
    return nudged(model.params, seed=1)


@pytest.fixture(scope="module")
def shared(model):
    with pj.LLM(model, **OPTIONS) as llm:
        yield llm


@pytest.fixture
def llm(shared, model):
    """The module's LLM back on the loaded weights (with nothing cached of any other)."""
    shared.update_params(model.params)
    return shared


@pytest.fixture(scope="module")
def reference(model, new_params):
    """What a fresh engine on the new weights answers."""
    with pj.LLM(dataclasses.replace(model, params=new_params), **OPTIONS) as fresh:
        return outputs(fresh)


def test_outputs_after_an_update_equal_a_fresh_engine_with_no_recompile_and_no_copy(llm, model, new_params,
                                                                                    reference):
    before = outputs(llm)
    assert before != reference  # the new weights answer differently: the comparison below can fail
    compiled = llm.engine.compiled_count()
    for i in range(20):  # an RL loop's updates: no program is compiled for any of them
        llm.update_params(nudged(model.params, seed=100 + i) if i < 19 else new_params)
    assert outputs(llm) == reference
    assert llm.engine.compiled_count() == compiled
    # the caller's arrays are served as they are: no second copy of the weights
    served = jax.tree.leaves(llm.engine.model.params)
    assert all(a is b for a, b in zip(served, jax.tree.leaves(new_params)))
    assert llm.model.params is llm.engine.model.params  # pj.logits(llm.model, ...) scores with what generates


def test_cached_prefixes_are_forgotten(llm, model, new_params, reference):
    outputs(llm)  # every prompt's K/V (of the old weights) now sits in a freed slot
    again = llm.submit(PROMPTS[0], greedy())
    again.result(timeout=120)
    assert again.cached_prefix_len > 0  # reused while the weights are the same
    llm.update_params(new_params)
    after = llm.submit(PROMPTS[0], greedy())
    done = after.result(timeout=120)
    assert after.cached_prefix_len == 0
    assert (done.token_ids, [lp for lp, _ in done.logprobs]) == reference[0]


def test_finish_running_lets_requests_in_flight_end_on_the_old_weights(llm, model, new_params, reference):
    long = greedy(48)
    alone_old = llm.generate(PROMPTS[1], long)[0]
    running = llm.submit(PROMPTS[1], long)
    while running.num_delivered == 0:  # the request is decoding on the old weights
        threading.Event().wait(0.01)
    llm.update_params(new_params, finish_running=True, timeout=300)
    assert running.done()  # update_params returned once the running request had finished
    old = running.result(timeout=0)
    assert old.token_ids == alone_old.token_ids
    assert [lp for lp, _ in old.logprobs] == [lp for lp, _ in alone_old.logprobs]
    assert outputs(llm) == reference


def test_a_request_in_flight_continues_on_the_new_weights(llm, model, new_params):
    long = greedy(40)
    alone_old = llm.generate(PROMPTS[2], long)[0]
    running = llm.submit(PROMPTS[2], long)
    while running.num_delivered == 0:
        threading.Event().wait(0.01)
    llm.update_params(new_params)
    out = running.result(timeout=300)
    assert len(out.token_ids) == 40
    assert [lp for lp, _ in out.logprobs] != [lp for lp, _ in alone_old.logprobs]  # its later steps are new


@pytest.mark.parametrize("change, where", [
    (lambda p: {**p, "final_norm": p["final_norm"][:-1]}, "['final_norm']"),
    (lambda p: {**p, "final_norm": p["final_norm"].astype(jnp.bfloat16)}, "['final_norm']"),
    (lambda p: {k: v for k, v in p.items() if k != "final_norm"}, "tree"),
])
def test_a_different_leaf_is_a_config_error_naming_it_and_nothing_changes(model, change, where):
    engine = pj.Engine(model, **OPTIONS)
    before = engine.model.params
    with pytest.raises(ConfigError, match="update_params") as error:
        engine.update_params(change(model.params))
    assert where in str(error.value)
    assert engine.model.params is before


def test_host_arrays_are_placed_on_the_engine_sharding(llm, model, new_params, reference):
    on_host = jax.tree.map(np.asarray, new_params)
    llm.update_params(on_host)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(llm.engine.model.params))
    assert outputs(llm) == reference
