"""The trainer sees the sampler in every form (README "Guarantees", issue 67): on a sequence an engine generated,
`pj.logprobs` / `pj.logits` / `pj.loss` with `kv_dtype=engine.kv_dtype` give the engine's raw logprobs bit for bit
(every prompt token's and every sampled token's), for each weight and cache form of the batch-invariance matrix
(`FORMS`), the bf16 model's float32 cache on CPU included; with kv_dtype=None, a default engine's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.errors import ConfigError, RequestError
from pocketjax.model import cpu_kernels
from pocketjax.model.numerics import fixed_logsumexp, fixed_sum

from test_batch_invariance import CHECKPOINT, FORMS, SIZES, load, make_engine
from test_speculative import run

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: XLA's forms, not bitwise")


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    return {dtype: hf_checkpoint(CHECKPOINT, dtype=dtype) for dtype in ("float32", "bfloat16")}


def sampled(engine: Engine, seed: int) -> tuple[list[int], np.ndarray]:
    """A sequence the engine generated (seeded sampling, prefilled in chunks beside another request) and the
    engine's raw logprob of each of its tokens after the first: the prompt's (prompt_logprobs), then the sampled."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    prompt, other = ([int(t) for t in rng.integers(0, vocab, n)] for n in (17, 11))
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=seed, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    req, _ = run(engine, [prompt, other], [params, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)],
                 engine.speculator is not None)  # speculative forms: verify steps give the sampled tokens
    engine_logprobs = [lp for lp, _ in req.prompt_logprobs[1:]] + [lp for lp, _ in req.logprobs]
    return prompt + req.generated_tokens, np.asarray(engine_logprobs, np.float32)


# CI's second leg runs two forms (the trainer's path under its JAX); every form's forward runs in both legs in the
# invariance matrix, so the others run in the first leg only (~40 s).
BOTH_LEGS = ("float32", "bfloat16-int4-fp8kv")


@pytest.mark.parametrize("form", [f if f in BOTH_LEGS else pytest.param(f, marks=pytest.mark.leg1_only) for f in FORMS])
def test_logprobs_and_loss_are_the_engines_bits(checkpoints, form):
    engine_options = FORMS[form][2]
    model = load(checkpoints, form)
    engine = make_engine(model, engine_options, prefill_chunk=8, **SIZES)
    assert engine.kv_dtype == engine_options.get("kv_dtype", "float32")  # CPU: a 16-bit model's cache is float32
    sequence, want = sampled(engine, seed=sorted(FORMS).index(form))
    got = np.asarray(pj.logprobs(model, [sequence], kv_dtype=engine.kv_dtype))
    assert got.shape == (1, len(sequence) - 1) and got.dtype == np.float32
    np.testing.assert_array_equal(got[0], want)
    if "kv_dtype" not in engine_options:  # the default engine's form is the default
        np.testing.assert_array_equal(np.asarray(pj.logprobs(model, [sequence]))[0], want)
    # the loss is minus the fixed-order mean of those logprobs
    mean = jax.jit(lambda x: -fixed_sum(x) / x.size)(jnp.asarray(want))
    assert float(pj.loss(model, [sequence], kv_dtype=engine.kv_dtype)) == float(mean)


@pytest.mark.parametrize("form", ["bfloat16", "int4-int8kv"])
def test_logits_are_the_engines_bits(checkpoints, form):
    """pj.logits with the engine's kv_dtype: log_softmax in the sampler's numerics gives its logprobs (the bf16 model
    on CPU attends over a float32 cache; before issue 67 pj.logits attended in bf16, 0.04 nats away)."""
    model = load(checkpoints, form)
    engine = make_engine(model, FORMS[form][2], prefill_chunk=8, **SIZES)
    sequence, want = sampled(engine, seed=1)
    logits = pj.logits(model, [sequence], kv_dtype=engine.kv_dtype)[0, :-1]
    scored = jax.jit(lambda x, t: jnp.take_along_axis(x, t[:, None], 1)[:, 0] - fixed_logsumexp(x))(
        logits, jnp.asarray(sequence[1:]))
    np.testing.assert_array_equal(np.asarray(scored), want)


def test_bad_input_is_refused_by_name(checkpoints):
    model = pj.load_model(checkpoints["float32"])
    with pytest.raises(RequestError, match="T >= 2"):
        pj.logprobs(model, [[1]])
    with pytest.raises(RequestError, match="integer token ids"):
        pj.logprobs(model, [[1.0, 2.0]])
    with pytest.raises(RequestError, match="must lie in"):
        pj.logprobs(model, [[1, model.config.vocab_size]])
    with pytest.raises(ConfigError, match="kv_dtype='int4'"):
        pj.logprobs(model, [[1, 2]], kv_dtype="int4")
    with pytest.raises(RequestError, match="integer token ids"):
        pj.loss(model, [[1.0, 2.0]])
