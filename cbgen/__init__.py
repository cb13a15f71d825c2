"""cbgen: continuous-batching generation for Hugging Face transformers causal LMs."""

from .config import EngineConfig
from .engine import EngineCore
from .generate import generate_batch
from .models import load_model
from .online import Engine, EngineClosedError, EngineOverloadedError
from .request import Completion, FinishReason, RequestOutput
from .rollout import Rollout, rollout
from .sampling import SamplingParams
from .speculative import SpeculativeConfig
from .structured import StructuredOutput

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineClosedError",
    "EngineCore",
    "EngineOverloadedError",
    "FinishReason",
    "RequestOutput",
    "Rollout",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutput",
    "generate_batch",
    "load_model",
    "rollout",
]
__version__ = "0.1.0"
