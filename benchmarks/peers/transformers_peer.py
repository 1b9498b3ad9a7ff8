"""transformers' generate on the same checkpoint and dtype: PyTorch CPU, greedy, KV cache, batch = c.

Prefill tok/s from one forward over the batch (logits for the last position only, as generate does); decode tok/s
from generate(max_new_tokens = min_new_tokens = gen_len) minus that prefill time.

    python -m benchmarks.peers.transformers_peer --json-in SPEC.json --json-out OUT.json
"""
from __future__ import annotations

import time
from types import SimpleNamespace

from benchmarks.peers import Emit, Prompts, Skip, main, record, vocab_size


def run(spec: SimpleNamespace, emit: Emit) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise Skip(f"torch / transformers not importable ({e}); pip install -e '.[dev]'") from e

    torch.set_num_threads(spec.threads)
    model = AutoModelForCausalLM.from_pretrained(spec.checkpoint, dtype=getattr(torch, spec.kind)).eval()
    prompts = Prompts(vocab_size(spec.checkpoint), seed=spec.seed)
    for c in spec.concurrency:
        def cycle(new_tokens: int) -> tuple[float, float]:
            ids = torch.tensor(prompts.make(c, spec.prompt_len))
            mask = torch.ones_like(ids)
            with torch.inference_mode():
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
                prefill_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                                     pad_token_id=0, eos_token_id=None)
                generate_s = time.perf_counter() - t0
            assert out.shape[1] == spec.prompt_len + new_tokens
            return prefill_s, generate_s

        cycle(2)  # warm-up: allocator, kernels, generate's setup
        runs = [cycle(spec.gen_len) for _ in range(spec.repeats)]
        emit([record("transformers", spec, c, [p for p, _ in runs], [max(g - p, 1e-9) for p, g in runs],
                     threads=torch.get_num_threads(), versions={"torch": torch.__version__})])


if __name__ == "__main__":
    main(run, "transformers")
