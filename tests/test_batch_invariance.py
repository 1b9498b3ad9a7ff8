"""Batch invariance, bit for bit (README "Guarantees", issue 43): a request's tokens, logprobs and top logprobs are
identical whether it runs alone or beside 1..max_batch_size-1 others of random lengths and sampling settings,
prefilled in one chunk or several, with or without a reused prefix, with speculation on or off (verified or not),
and in a fresh process, for every weight and cache form the CPU engine runs. Compositions are random with fixed
seeds; under TP2 too (each device runs the kernels on its shard). `Engine(batch_invariant=False)` (XLA's forms) fails
the same comparison: the test of the test."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.model import cpu_kernels
from pocketjax.model.lora import Adapter, Lora, LoraConfig, attach

from test_speculative import run  # allocate, prefill, step to completion (speculative or plain), free

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: XLA's forms, not invariant")

SIZES = dict(max_batch_size=4, max_seq_len=128)
CHECKPOINT = "qwen3_gqa4_headdim"
SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
FORMS = {  # name: (checkpoint dtype, load_model options, Engine options); each weight and cache form at least once
    "float32": ("float32", {}, {}),
    "bfloat16": ("bfloat16", dict(dtype="bfloat16"), {}),
    "int8+head": ("float32", dict(quantize="int8+head"), {}),  # int8 linears, embedding and lm_head
    "int4-int8kv": ("float32", dict(quantize="int4"), dict(kv_dtype="int8")),
    "float32-fp8kv": ("float32", {}, dict(kv_dtype="float8_e4m3fn")),  # opaque's float32 form beside fp8 casts
    "bfloat16-int4-fp8kv": ("bfloat16", dict(dtype="bfloat16", quantize="int4"), dict(kv_dtype="float8_e4m3fn")),
    "float32-lora": ("float32", dict(scan_layers=False), {}),  # + an unmerged adapter (ADAPTERS)
    "int4-int8kv-speculative": ("float32", dict(quantize="int4"), dict(kv_dtype="int8", speculative=SPEC)),
}
# one TP2 engine on two CPU devices (conftest): the kernels per device under shard_map. Apart from FORMS, which the
# trainer's tests also run: pj.logits on a mesh runs XLA's forms (README "Guarantees")
MATRIX = {**FORMS, "float32-tp2": ("float32", dict(tp=2), {})}
ADAPTERS = {"float32-lora": LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "down"))}


def load(checkpoints: dict, form: str):
    """The model of a MATRIX entry: its checkpoint loaded with its options, with its unmerged adapter attached (random
    A and B: PEFT's zero B would make the adapter a no-op)."""
    dtype, load_options, _ = MATRIX[form]
    model = pj.load_model(checkpoints[dtype], **load_options)
    if form not in ADAPTERS:
        return model
    config, rng = ADAPTERS[form], np.random.default_rng(9)
    def pair(w):
        a, b = (0.2 * rng.standard_normal(shape).astype(np.float32) for shape in
                ((config.rank, w.shape[1]), (w.shape[0], config.rank)))
        return Lora(a, b, config.scaling)
    layers = model.params["layers"]
    adapter = Adapter(config, tuple({name: pair(p[name]) for name in config.targets} for p in layers))
    return dataclasses.replace(model, params=attach(model.params, adapter))


def make_engine(model, engine_options: dict, **options) -> Engine:
    """An Engine with a MATRIX entry's options; a speculative one verifies every draft (the timing policy is tested
    apart), so verify steps meet batches and chunks in the matrix."""
    made = Engine(model, **options, **engine_options)
    if made.speculator is not None:
        made.speculator.pays = lambda *_: True
    return made


def outcome(req: BatchedRequest) -> tuple:
    """What must be bitwise equal: the tokens, each token's logprob and its top logprobs (ids and values)."""
    return req.generated_tokens, [(lp, list(top.items())) for lp, top in req.logprobs]


def random_sampling(rng: np.random.Generator, logprobs: int = 0) -> SamplingParams:
    """Greedy, or seeded sampling with random temperature / top-k / top-p / min-p / penalties."""
    if rng.random() < 0.4:
        return SamplingParams(max_tokens=int(rng.integers(2, 12)), temperature=0.0, ignore_eos=True,
                              logprobs=logprobs)
    return SamplingParams(max_tokens=int(rng.integers(2, 12)), temperature=float(rng.uniform(0.3, 1.5)),
                          top_k=int(rng.choice([0, 5, 40])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
                          min_p=float(rng.choice([0.0, 0.05])), repetition_penalty=float(rng.choice([1.0, 1.3])),
                          presence_penalty=float(rng.choice([0.0, 0.5])), seed=int(rng.integers(1 << 30)),
                          ignore_eos=True, logprobs=logprobs)


def targets(rng: np.random.Generator, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """One greedy and one seeded-sampling request to follow, with 2 top logprobs."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_k=30, top_p=0.9, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.2, seed=7, ignore_eos=True, logprobs=2)
    return [([int(t) for t in rng.integers(0, vocab, int(rng.integers(2, 70)))], s) for s in (greedy, sampled)]


def matrix_cells(model, seed: int, engine_options: dict, batch_invariant: bool = True) -> dict[str, int]:
    """Runs the matrix for one model form; returns how many comparisons each cell made (asserting equality) or,
    with batch_invariant=False, raises AssertionError at the first difference."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    options = dict(SIZES, batch_invariant=batch_invariant)
    spec = "speculative" in engine_options
    engine = make_engine(model, engine_options, prefill_chunk=32, **options)
    chunked = make_engine(model, engine_options, prefill_chunk=8, **options)  # every prompt in several chunks
    cells = {"batched": 0, "chunked": 0, "prefix": 0}
    for prompt, params in targets(rng, vocab):
        (alone,) = run(engine, [prompt], [params], spec)
        assert alone.cached_prefix_len == 0
        want = outcome(alone)
        for _ in range(2):  # beside 1..max_batch_size-1 others, the target in a random row
            others = [([int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 90)))], random_sampling(rng, 1))
                      for _ in range(int(rng.integers(1, SIZES["max_batch_size"])))]
            batch = others[:]
            at = int(rng.integers(0, len(batch) + 1))
            batch.insert(at, (prompt, params))
            got = run(engine, [p for p, _ in batch], [s for _, s in batch], spec)[at]
            assert outcome(got) == want, "beside others"
            cells["batched"] += 1
        (got,) = run(chunked, [prompt], [params], spec)
        assert outcome(got) == want, "prefilled in chunks of 8"
        cells["chunked"] += 1
        shared = int(rng.integers(1, len(prompt))) if len(prompt) > 1 else 1
        run(engine, [prompt[:shared] + [int(t) for t in rng.integers(0, vocab, 5)]], [random_sampling(rng)], spec)
        (got,) = run(engine, [prompt], [params], spec)  # its prefix now comes from the slot the last request left
        assert got.cached_prefix_len > 0 and outcome(got) == want, "with a reused prefix"
        cells["prefix"] += 1
    if spec:  # verify steps ran (drafts from the prompts' n-grams), in both engines
        assert engine.speculator.total_proposed > 0 and chunked.speculator.total_proposed > 0
    return cells


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    return {dtype: hf_checkpoint(CHECKPOINT, dtype=dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("form", list(MATRIX))
def test_a_request_is_the_same_bits_alone_batched_chunked_and_with_a_reused_prefix(checkpoints, form):
    cells = matrix_cells(load(checkpoints, form), seed=sorted(MATRIX).index(form), engine_options=MATRIX[form][2])
    assert cells == {"batched": 4, "chunked": 2, "prefix": 2}


def test_xla_forms_are_not_invariant_so_the_matrix_can_fail(checkpoints):
    """batch_invariant=False (XLA's product and attention forms) differs in the last bits in the matrix: the
    comparison above is not one that any implementation passes."""
    with pytest.raises(AssertionError):
        matrix_cells(pj.load_model(checkpoints["float32"]), seed=0, engine_options={}, batch_invariant=False)


@pytest.mark.parametrize("form", ["float32", "bfloat16"])
def test_speculation_gives_the_plain_bits_verified_or_not(checkpoints, form):
    """Speculative steps (drafts verified, k + 1 positions per row in one pass) give the bits of plain decoding,
    alone and beside others: which program computed a position never shows in its output, so a speculation policy
    that decides from timings cannot change a request's output."""
    dtype, load_options, _ = FORMS[form]
    model = pj.load_model(checkpoints[dtype], **load_options)
    plain, spec = Engine(model, prefill_chunk=32, **SIZES), Engine(model, prefill_chunk=32, speculative=SPEC, **SIZES)
    spec.speculator.pays = lambda *_: True  # verify whenever a draft exists (the policy on time is tested apart)
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size
    base = [int(t) for t in rng.integers(0, vocab, 12)]
    prompts = [base * 4, base[:5] * 6 + base, [int(t) for t in rng.integers(0, vocab, 30)]]  # drafts find matches
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)]
    want = [outcome(run(plain, [p], [s], False)[0]) for p, s in zip(prompts, params)]
    for i, (p, s) in enumerate(zip(prompts, params)):
        assert outcome(run(spec, [p], [s], speculative=True)[0]) == want[i]
    together = run(spec, prompts, params, speculative=True)
    assert [outcome(r) for r in together] == want
    assert spec.speculator.total_accepted > 0  # drafts were verified and accepted, not only proposed


FRESH = """
import json, sys
import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling_params import SamplingParams
engine = Engine(pj.load_model(sys.argv[1]), prefill_chunk=32, max_batch_size=4, max_seq_len=128)
req = BatchedRequest(0, json.loads(sys.argv[2]), SamplingParams(max_tokens=8, temperature=0.9, seed=7,
                     ignore_eos=True, logprobs=2))
engine.allocate_slot(req)
engine.batch_prefill([req])
while not req.finished:
    engine.batch_decode_step([req])
print(json.dumps([req.generated_tokens, [(lp, list(top.items())) for lp, top in req.logprobs]]))
"""


def test_a_fresh_process_gives_the_same_bits(checkpoints):
    model = pj.load_model(checkpoints["float32"])
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, model.config.vocab_size, 21)]
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)
    tokens, logprobs = outcome(run(Engine(model, prefill_chunk=32, **SIZES), [prompt], [params], False)[0])
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", FRESH, str(checkpoints["float32"]), json.dumps(prompt)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh_tokens, fresh_logprobs = json.loads(done.stdout.strip().splitlines()[-1])
    # JSON writes floats as their shortest round-trip repr: equal floats are equal bits
    assert fresh_tokens == tokens
    assert [(lp, [tuple(t) for t in top]) for lp, top in fresh_logprobs] == logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_opaque_is_the_identity_bit_for_bit_and_keeps_nans(dtype):
    """numerics.opaque returns every non-NaN value's bits unchanged (zeros, subnormals, the largest values,
    infinities, both signs) and every NaN as a NaN, its bits OR-ed with 1 (what `bits | (x != x)` gave), jitted."""
    import jax
    import jax.numpy as jnp
    from pocketjax.model.numerics import opaque
    info = jnp.finfo(dtype)
    bits_type = np.uint32 if dtype == "float32" else np.uint16
    special = np.array([0.0, -0.0, float(info.smallest_subnormal), -float(info.smallest_subnormal), float(info.max),
                        -float(info.max), np.inf, -np.inf, 1.0, -2.5], np.float32)
    x = jnp.concatenate([jnp.asarray(special, dtype),
                         jnp.asarray(np.random.default_rng(3).standard_normal(64), dtype)])
    nan_bits = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFE] if dtype == "float32" else
                        ([0x7FC0, 0xFFC1, 0x7F81, 0x7FFE] if dtype == "bfloat16" else [0x7E00, 0xFE01, 0x7C01, 0x7FFE]),
                        bits_type)
    x = jnp.concatenate([x, jax.lax.bitcast_convert_type(jnp.asarray(nan_bits), jnp.dtype(dtype))])
    got = np.asarray(jax.lax.bitcast_convert_type(jax.jit(opaque)(x), jnp.dtype(bits_type)))
    want = np.asarray(jax.lax.bitcast_convert_type(x, jnp.dtype(bits_type)))
    is_nan = np.isnan(np.asarray(x, np.float32))
    assert is_nan.sum() == 4
    np.testing.assert_array_equal(got[~is_nan], want[~is_nan])
    np.testing.assert_array_equal(got[is_nan], want[is_nan] | 1)


MOE_FORMS = {  # name: (checkpoint, load_model options, Engine options)
    "qwen2_moe-speculative": ("qwen2_moe", {}, dict(speculative=SPEC)),
    # one TP2 engine: each device runs the expert kernels on its half of every expert (model/moe.py), the router,
    # the shared expert and its gate on theirs, as "float32-tp2" does for a dense model
    "qwen2_moe-tp2": ("qwen2_moe", dict(tp=2), {}),
}


@pytest.mark.parametrize("form", list(MOE_FORMS))
def test_a_mixture_of_experts_request_is_the_same_bits_in_every_composition(moe_checkpoint, form):
    """The matrix's cells for qwen2_moe (issue 68), with speculation on one device, and on a TP2 mesh: a token's
    experts and their products depend on its own hidden state only (the router's sums fixed, each (token, expert) pair
    the product kernel's row, per device on its shard under TP2, the shards' partial sums added in one fixed psum), so
    batches, chunks, a reused prefix and verify steps keep a request's bits, the shared expert and a dense layer among
    sparse ones included. (qwen2_moe: measured cheaper here than qwen3_moe, 82 vs 100 s of CPU under load.) Apart
    from MATRIX, whose forms other tests load from the dense checkpoints."""
    name, load_options, engine_options = MOE_FORMS[form]
    model = pj.load_model(moe_checkpoint(name), **load_options)
    cells = matrix_cells(model, seed=68, engine_options=engine_options)
    assert cells == {"batched": 4, "chunked": 2, "prefix": 2}
