"""cbgen: continuous-batching generation for Hugging Face transformers causal LMs."""

from .core.config import EngineConfig
from .core.engine_core import EngineCore
from .core.loras import LoraInfo
from .executor.parallel.executor import TensorParallelError
from .frontends.generate import generate_batch
from .frontends.online import Engine, EngineClosedError, EngineOverloadedError
from .models.loader import load_model
from .requests.request import Completion, FinishReason, RequestOutput
from .rl.peft_rollouts import PeftRollouts
from .rl.rollout import Rollout, rollout
from .sampling.params import SamplingParams
from .sampling.structured import ReasoningSection, StructuredOutput
from .spec.speculative import SpeculativeConfig

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineClosedError",
    "EngineCore",
    "EngineOverloadedError",
    "FinishReason",
    "LoraInfo",
    "PeftRollouts",
    "RequestOutput",
    "Rollout",
    "SamplingParams",
    "SpeculativeConfig",
    "ReasoningSection",
    "StructuredOutput",
    "TensorParallelError",
    "generate_batch",
    "load_model",
    "rollout",
]
__version__ = "0.1.0"
