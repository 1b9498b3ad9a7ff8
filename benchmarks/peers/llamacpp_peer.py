"""llama.cpp through llama-cpp-python's low-level API, one GGUF encoding per process (spec "kind": float32, float16,
bfloat16, q8_0, q4_0, q4_k_m; quantized rows carry quantize=<kind>), from spec "gguf" for the checkpoint's own
dtype, else <spec "gguf_dir" or the checkpoint folder>/model-<kind>.gguf.

Speed: one llama_decode over the c prompts for prefill, then one llama_decode per step over c sequences (greedy
argmax on the host). Perplexity (spec "task": "perplexity", "tokens": [[...], ...]): every position's logits of
each sequence in one llama_decode, the mean negative log-likelihood of the next token, exp'd; bench_quant.py sets it
beside pocketjax's int4 on the same held-out windows. The GGUF comes from `presets.gguf_file` (converted or
quantized on first use).

    python -m benchmarks.peers.llamacpp_peer --json-in SPEC.json --json-out OUT.json
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.peers import Emit, Prompts, Skip, main, record, vocab_size

FLOAT_KINDS = ("float32", "float16", "bfloat16")


class Context:
    """A llama.cpp model and one context of `n_ctx` cells for up to `n_seq` sequences, with a batch of `n_batch`."""

    def __init__(self, path: Path, n_ctx: int, n_batch: int, n_seq: int, threads: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        load = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
        self.model = load(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        new_ctx = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
        self.ctx = new_ctx(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)

    def clear(self) -> None:
        L = self.L
        if hasattr(L, "llama_memory_clear"):  # the API was renamed twice across llama.cpp versions
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        elif hasattr(L, "llama_kv_self_clear"):
            L.llama_kv_self_clear(self.ctx)
        else:
            L.llama_kv_cache_clear(self.ctx)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) rows."""
        batch = self.batch
        batch.n_tokens = len(rows)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(logits)
        if self.L.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def logits(self, i: int, vocab: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(vocab,))

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        (getattr(L, "llama_model_free", None) or L.llama_free_model)(self.model)


def gguf(spec: SimpleNamespace) -> Path:
    """The spec's GGUF: spec.gguf for the checkpoint's own dtype when given, else converted / quantized once."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise Skip("llama-cpp-python is not installed (see benchmarks/README.md)") from e
    from benchmarks.presets import gguf_file

    override = getattr(spec, "gguf", None) if spec.kind == spec.dtype else None
    try:
        return gguf_file(spec.checkpoint, spec.kind, override, getattr(spec, "gguf_dir", None))
    except Exception as e:  # noqa: BLE001 - any conversion failure is a skip, with its reason
        raise Skip(f"no GGUF for {spec.kind} and converting failed ({type(e).__name__}: {e})") from e


def speed(spec: SimpleNamespace, emit: Emit) -> None:
    path, vocab = gguf(spec), vocab_size(spec.checkpoint)
    quantized = spec.kind not in FLOAT_KINDS
    prompts = Prompts(vocab, seed=spec.seed)
    for c in spec.concurrency:
        llm = Context(path, c * (spec.prompt_len + spec.gen_len) + 64, max(c * spec.prompt_len, c), c, spec.threads)

        def cycle() -> tuple[float, float]:
            llm.clear()
            ps = prompts.make(c, spec.prompt_len)
            t0 = time.perf_counter()
            llm.decode([(t, j, s, j == spec.prompt_len - 1) for s, p in enumerate(ps) for j, t in enumerate(p)])
            last = [int(np.argmax(llm.logits((s + 1) * spec.prompt_len - 1, vocab))) for s in range(c)]
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for step in range(spec.gen_len - 1):
                llm.decode([(last[s], spec.prompt_len + step, s, True) for s in range(c)])
                last = [int(np.argmax(llm.logits(s, vocab))) for s in range(c)]
            return prefill_s, time.perf_counter() - t0

        cycle()
        runs = [cycle() for _ in range(spec.repeats)]
        llm.close()
        emit([record("llamacpp", spec, c, [p for p, _ in runs], [d for _, d in runs],
                     dtype=spec.dtype if quantized else spec.kind, quantize=spec.kind if quantized else None,
                     threads=spec.threads, gguf=str(path), versions=versions())])


def perplexity(spec: SimpleNamespace, emit: Emit) -> None:
    path, vocab = gguf(spec), vocab_size(spec.checkpoint)
    tokens = np.asarray(spec.tokens, np.int64)
    length = tokens.shape[1]
    llm = Context(path, length + 16, length, 1, spec.threads)
    nll = []
    for seq in tokens:
        llm.clear()
        llm.decode([(int(t), j, 0, True) for j, t in enumerate(seq[:-1])])
        logits = np.stack([llm.logits(j, vocab) for j in range(length - 1)]).astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll.append(-logp[np.arange(length - 1), seq[1:]].mean())
    llm.close()
    ppl = float(np.exp(np.mean(nll)))
    print(f"llamacpp {spec.kind}: perplexity {ppl:.4f} over {len(tokens)} x {length} tokens", flush=True)
    emit([{"system": "llamacpp", "kind": "ppl", "variant": f"llama.cpp {spec.kind} GGUF", "gguf_type": spec.kind,
           "ppl": ppl, "gguf": str(path), "gguf_bytes": path.stat().st_size, "versions": versions()}])


def versions() -> dict:
    import llama_cpp

    return {"llama_cpp_python": llama_cpp.__version__}


def run(spec: SimpleNamespace, emit: Emit) -> None:
    (perplexity if getattr(spec, "task", "speed") == "perplexity" else speed)(spec, emit)


if __name__ == "__main__":
    main(run, "llamacpp")
