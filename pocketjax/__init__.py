"""pocketjax: pure-JAX batched inference for Qwen2 / Qwen2.5 / Qwen3 decoders.

Layers, bottom to top (imports flow downwards only): `model/` (config, checkpoint, layers, the decoder, KV cache,
quantization, sharding), `engine/` (requests, slots, jitted steps, sampler, Engine), `serve/` (handles,
scheduler, tokenizer, LLM, CLI). `training/` trains the embedded model and is not imported here.
"""
from . import errors
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.generate import Generation, generate
from .engine.request import BatchedRequest, Completion
from .engine.sampling_params import SamplingParams
from .engine.structured import Structured
from .model.config import ModelConfig
from .model.decoder import Model, load_model, logits, logprobs, loss
from .model.memory import MemoryPlan, plan_memory
from .serve.llm import LLM, Score
from .serve.scheduler import RequestHandle, Scheduler

__all__ = [
    "errors", "ModelConfig", "EngineConfig", "Model", "load_model", "logits", "Engine", "BatchedRequest",
    "Completion", "SamplingParams", "Structured", "Scheduler", "RequestHandle", "LLM", "Score", "loss", "logprobs",
    "MemoryPlan", "plan_memory", "generate", "Generation",
]
__version__ = "0.1.0"
