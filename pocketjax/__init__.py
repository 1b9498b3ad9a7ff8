"""pocketjax: pure-JAX batched inference for Qwen2 / Qwen2.5 / Qwen3 decoders."""
from . import errors
from .config import ModelConfig
from .model import Model, load_model, logits

__all__ = ["errors", "ModelConfig", "Model", "load_model", "logits"]
__version__ = "0.1.0"
