"""pocketjax: pure-JAX batched inference for Qwen2 / Qwen2.5 / Qwen3 decoders."""
from . import errors
from .config import EngineConfig, ModelConfig
from .engine import BatchedRequest, Completion, Engine
from .llm import LLM
from .memory import MemoryPlan, plan_memory
from .model import Model, load_model, logits
from .sampling import SamplingParams
from .scheduler import RequestHandle, Scheduler
from .train import loss

__all__ = [
    "errors", "ModelConfig", "EngineConfig", "Model", "load_model", "logits", "Engine", "BatchedRequest",
    "Completion", "SamplingParams", "Scheduler", "RequestHandle", "LLM", "loss", "MemoryPlan", "plan_memory",
]
__version__ = "0.1.0"
