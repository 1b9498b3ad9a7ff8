"""Command line: `pocketjax generate | chat | serve | bench | info | finetune` (also `python -m pocketjax`)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ..engine.config import ENVIRONMENT, EngineConfig
from ..errors import ConfigError, PocketJaxError
from ..engine.sampling_params import LOGPROBS_MODES, SamplingParams
from ..model.config import DTYPES
from ..model.kv_cache import KV_DTYPES
from ..model.layers import ATTENTION_IMPLS
from ..model.quant import MODES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder or Hub repo id, e.g. Qwen/Qwen3-0.6B (default: the embedded model)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit of a --model repo id")
    p.add_argument("--dtype", default=None, choices=DTYPES)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--quantize", default=None, choices=sorted(MODES), help="weight-only quantization at load")
    p.add_argument("--scan-layers", dest="scan_layers", default="auto", choices=["auto", "on", "off"],
                   help="layer loop: one lax.scan over stacked layers (on: compiles once whatever the depth), unrolled "
                        "(off: faster steps on CPU), or auto (load_model's rule)")
    engine = p.add_argument_group("engine (EngineConfig; unset: its defaults)")
    engine.add_argument("--max-seq-len", dest="max_seq_len", type=int)
    engine.add_argument("--max-batch-size", dest="max_batch_size", type=int)
    engine.add_argument("--prefill-chunk", dest="prefill_chunk", type=int)
    engine.add_argument("--attention", dest="attention_impl", choices=ATTENTION_IMPLS)
    engine.add_argument("--kv-dtype", dest="kv_dtype", choices=KV_DTYPES, help="KV cache dtype (default: the model's)")
    engine.add_argument("--compile-cache-dir", dest="compile_cache_dir",
                        help="JAX's persistent compilation cache folder (default ~/.cache/pocketjax/xla; 'off')")
    engine.add_argument("--batch-invariant", dest="batch_invariant", action=argparse.BooleanOptionalAction,
                        default=None, help="CPU: pocketjax's native kernels, so a request's bits never depend on its "
                                           "batch (default on; --no-batch-invariant: XLA's forms)")
    engine.add_argument("--logprobs-mode", dest="logprobs_mode", choices=LOGPROBS_MODES,
                        help="which values logprobs report (vLLM's names): raw_logprobs (default: of the model's "
                             "logits), processed_logprobs (of the distribution sampled from, after masks, logit_bias, "
                             "penalties, temperature, top_k/top_p/min_p), raw_logits, processed_logits")
    engine.add_argument("--decode-steps", dest="decode_steps", type=int,
                        help="decode steps per dispatch (one program; rows stop on the device): the same tokens")
    engine.add_argument("--speculative-config", dest="speculative", metavar="JSON",
                        help='speculative decoding (vLLM\'s spelling), e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every engine shape before the first request (default: on for serve, which listens "
                        "at once: /health answers 503 'warming' with its progress and generation routes 503 with "
                        "Retry-After until it is done, so no client waits for a compile; off for generate and chat)")
    job = p.add_argument_group("multi-process job (jax.distributed; unset: one process). Start the same command in "
                               "every process: process 0 takes the requests and prints, the others follow it")
    job.add_argument("--num-processes", dest="num_processes", type=int, help="processes in the job ($JAX_NUM_PROCESSES)")
    job.add_argument("--process-id", dest="process_id", type=int, help="this process, 0 to N-1 ($JAX_PROCESS_ID)")
    job.add_argument("--coordinator", help="HOST:PORT where process 0 listens ($JAX_COORDINATOR_ADDRESS)")


ENGINE_OPTIONS = (*ENVIRONMENT, "speculative")  # every option a flag (or a POCKETJAX_* variable) sets


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags ask for: flags given win over POCKETJAX_* variables, then the defaults."""
    return EngineConfig.of(**{k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None})


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def join_job(args: argparse.Namespace) -> bool:
    """Join the multi-process job the flags (or JAX_* variables) describe, before JAX runs anything; False: alone."""
    from .distributed import initialize
    return initialize(args.coordinator, args.num_processes, args.process_id)


def follows(llm) -> bool:
    """True on a process other than 0 of a multi-process job: its LLM steps in lockstep with process 0 and the
    command does nothing else there (leaving the `with` block waits until process 0 closes)."""
    group = llm.scheduler.group
    return group is not None and not group.leader


def make_llm(args: argparse.Namespace):
    from .llm import LLM
    return LLM(args.model, engine_config(args), dtype=args.dtype, tp=args.tp, quantize=args.quantize,
               revision=args.revision, warmup=warms_up(args) and not warms_up_listening(args),
               scan_layers=scan_layers(args))


def warms_up(args: argparse.Namespace) -> bool:
    """--warmup / --no-warmup, else on for `serve` only (vLLM warms up before it reports ready)."""
    return args.warmup if args.warmup is not None else args.command == "serve"


def warms_up_listening(args: argparse.Namespace) -> bool:
    """Whether `serve` warms up while it listens (`http.readiness`) rather than before: one process only (in a
    multi-process job every process steps in lockstep from the LLM's construction, so it warms up there)."""
    from .distributed import ProcessGroup
    return args.command == "serve" and warms_up(args) and ProcessGroup.current() is None


def scan_layers(args: argparse.Namespace) -> bool | str:
    """--scan-layers auto|on|off as load_model's scan_layers."""
    return {"on": True, "off": False}.get(args.scan_layers, args.scan_layers)


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("no prompt given (pass PROMPT arguments or lines on stdin)", file=sys.stderr)
        return 2
    with make_llm(args) as llm:
        if follows(llm):
            return 0
        sampling = sampling_from(args)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # compile outside the timing
        start = time.perf_counter()
        if args.stream:
            count = 0
            for prompt in prompts:
                print(prompt, end="", flush=True)
                for piece in llm.stream(prompt, sampling):
                    print(piece, end="", flush=True)
                    count += 1
                print()
            tokens = count
        else:
            outs = llm.generate(prompts, sampling)
            for prompt, out in zip(prompts, outs):
                print(f"{prompt}{out.text}")
                print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
            tokens = sum(len(o.token_ids) for o in outs)
        elapsed = time.perf_counter() - start
        print(f"[pocketjax] {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s "
              f"({len(prompts)} prompt(s), attention={llm.engine.impl})", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    messages = []
    with make_llm(args) as llm:
        if follows(llm):
            return 0
        print("chat with the model; an empty line or EOF ends", file=sys.stderr)
        for line in sys.stdin:
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.strip()})
            reply = llm.chat(messages, sampling_from(args))
            print(reply.text, flush=True)
            messages.append({"role": "assistant", "content": reply.text})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from .http.http_guard import ServerLimits
    from .http.server import default_model_name, serve
    api_key = args.api_key if args.api_key is not None else os.environ.get("POCKETJAX_API_KEY")
    if api_key is not None and not api_key.strip():  # an empty key would silently turn authentication off
        raise ConfigError("--api-key (or $POCKETJAX_API_KEY) is empty: give a key, or leave it unset for no key")
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                          header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                          max_prompt_chars=args.max_prompt_chars)  # checked before the model loads
    with make_llm(args) as llm:
        if follows(llm):
            return 0
        serve(llm, args.host, args.port, api_key=api_key, max_waiting=args.max_waiting, log_level=args.log_level,
              model_name=args.served_model_name or args.model or default_model_name(llm),
              trust_request_chat_template=args.trust_request_chat_template, limits=limits,
              warmup=warms_up_listening(args))
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (beyond 127.0.0.1, set --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 (default: $POCKETJAX_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients pass (default: --model, or the "
                                                             "embedded model's name)")
    p.add_argument("--max-waiting", type=int, default=1024, help="queued requests before new ones get 429")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    guard = p.add_argument_group("untrusted clients (docs/security.md)")
    guard.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests pass chat_template_kwargs.chat_template (a template is code; default: 400)")
    guard.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body limit (413 past it)")
    guard.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a body (408 past it)")
    guard.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds for a request's headers to arrive before the connection is closed")
    guard.add_argument("--max-connections", type=int, default=None,
                       help="open connections (past it the one waiting longest for its headers is closed; requests "
                            "past it get 503); default: 3/4 of `ulimit -n`, keeping the rest for the process's own "
                            "files")
    guard.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longest text prompt or conversation (default: 32 characters per token of --max-seq-len)")


def cmd_finetune(args: argparse.Namespace) -> int:
    import importlib
    # training/ sits above serve/ in the layering (tests/test_layout.py), so the CLI reaches it by name at call time
    return importlib.import_module("pocketjax.training.finetune").main(args.rest)


def cmd_info(args: argparse.Namespace) -> int:
    import jax

    from ..model.decoder import load_model
    from ..model.layers import resolve_impl
    from ..model.kv_cache import default_kv_dtype
    from ..model.memory import per_device_bytes, plan_memory
    from .llm import DEFAULT_MODEL
    model = load_model(args.model or DEFAULT_MODEL, dtype=args.dtype, tp=args.tp, quantize=args.quantize,
                       revision=args.revision, scan_layers=scan_layers(args))
    config = engine_config(args)
    c = model.config
    info = {
        "path": model.path, "model_type": c.model_type, "layers": c.num_layers, "hidden": c.hidden_size,
        "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
        "parameters": c.num_params(), "dtype": str(model.dtype), "rope": c.rope.rope_type,
        "scan_layers": model.scan_layers,
        "devices": [str(d) for d in jax.devices()],
        "attention": resolve_impl(config.attention_impl, config.kv_dtype),
        "placed_bytes": {str(d): n for d, n in per_device_bytes(model.params).items()},
        "memory_plan": plan_memory(c, tp=args.tp, dtype=str(model.dtype), quantize=args.quantize,
                                   kv_dtype=config.kv_dtype or default_kv_dtype(model.dtype), slots=config.max_batch_size,
                                   max_seq_len=config.max_seq_len).as_dict(),
    }
    print(json.dumps(info, indent=2))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"
    if not script.exists():
        print("benchmarks/bench_engine.py is not available in this installation", file=sys.stderr)
        return 2
    sys.argv = [str(script)] + args.rest
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pocketjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (args or stdin lines)")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--stream", action="store_true")
    chat = sub.add_parser("chat", help="interactive chat with the chat template")
    info = sub.add_parser("info", help="config, parameter count, memory plan, devices, attention path")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_serve_args(serve)
    for p in (gen, chat, info, serve):
        add_model_args(p)
    for p in (gen, chat):
        add_sampling_args(p)
    bench = sub.add_parser("bench", help="benchmarks/bench_engine.py (arguments pass through)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("finetune", add_help=False, help="LoRA fine-tuning into a PEFT adapter folder "
                   "(pocketjax.training.finetune; arguments pass through, --help lists them)")
    args, rest = parser.parse_known_args(argv)  # finetune's own arguments are parsed by its module
    if rest and args.command != "finetune":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "finetune":
        args.rest = rest
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[pocketjax] %(message)s"))
    logging.getLogger("pocketjax").addHandler(handler)
    logging.getLogger("pocketjax").setLevel(logging.INFO)
    try:
        if hasattr(args, "num_processes"):
            join_job(args)
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "serve": cmd_serve,
                "bench": cmd_bench, "finetune": cmd_finetune}[args.command](args)
    except PocketJaxError as error:  # bad input is a one-line message and exit status 2, not a traceback
        print(f"pocketjax: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
