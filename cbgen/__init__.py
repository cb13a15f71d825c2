"""cbgen: continuous-batching generation for Hugging Face transformers causal LMs."""

from .config import EngineConfig
from .engine import Engine
from .generate import generate_batch
from .models import load_model
from .online import OnlineEngine
from .request import FinishReason, RequestOutput
from .sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "FinishReason",
    "OnlineEngine",
    "RequestOutput",
    "SamplingParams",
    "generate_batch",
    "load_model",
]
__version__ = "0.1.0"
