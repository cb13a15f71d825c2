"""Run the model: one forward pass per step over the packed batch."""

from __future__ import annotations

from types import ModuleType

import torch

from . import attention
from .attention import ProbeRecord, attention_context
from .batch import StepBatch
from .fast_forward import FastForward, build_fast_forward
from .prepack import PackedLinears, prepack_enabled_by_default


class ModelRunner:
    """Owns the model's attention switch and the forward call.

    On construction it switches the model to cbgen's paged attention and probes
    it with a two-token forward to learn, per attention layer, how many K/V
    heads and which head sizes it stores (read off the tensors the layer
    actually produces, so no per-architecture config keys are needed).
    ``close()`` restores the model's own attention implementation.

    ``prepack_linear`` switches the model's float32 CPU ``nn.Linear`` modules to
    oneDNN prepacked weights for the runner's lifetime (``cbgen.prepack``; the
    linear maps are most of a CPU decode step). ``None`` means on for float32
    models on CPU unless ``CBGEN_NO_PREPACK=1``; ``close()`` undoes it.

    ``kernels`` is the compiled native-kernel module (``cbgen.kernels``) or None.
    With it and prepacked weights, Llama-family models run their decoder through
    ``cbgen.fast_forward`` instead of the model's ``forward`` (``fast_forward`` says
    which one this runner uses).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        prepack_linear: bool | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        self.model = model
        self._packed: PackedLinears | None = None
        self.fast_forward: FastForward | None = None
        self.device = model_device(model)
        attention.register()
        self._original_attention = model.config._attn_implementation
        model.set_attn_implementation(attention.ATTENTION_NAME)
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            self.close()
            raise ValueError(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface, so cbgen cannot page its KV cache"
            )
        try:
            self.probe = self._probe()
            self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
            if prepack_linear is None:
                prepack_linear = prepack_enabled_by_default(model)
            if prepack_linear:
                self._packed = PackedLinears(model)
            self.fast_forward = build_fast_forward(model, self._packed, self.probe, kernels)
        except BaseException:
            self.close()
            raise

    @property
    def prepacked_linears(self) -> int:
        """How many ``nn.Linear`` modules currently run on prepacked weights."""
        return len(self._packed) if self._packed is not None else 0

    def _probe(self) -> ProbeRecord:
        record = ProbeRecord()
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        positions = torch.arange(2, device=self.device).unsqueeze(0)
        with torch.inference_mode(), attention_context(record):
            self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
        if not record.layers:
            raise ValueError(f"{type(self.model).__name__} ran no attention layer through cbgen")
        return record

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Return the logits of the sampled rows, ``[samples, vocab]``."""
        if self.fast_forward is not None:
            with torch.inference_mode():
                return self.fast_forward(batch)
        if batch.logits_indices.numel() == 0:
            logits_to_keep: int | torch.Tensor = 1  # nothing to sample; keep the LM head tiny
        else:
            logits_to_keep = batch.logits_indices
        with torch.inference_mode(), attention_context(batch.attention):
            output = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=logits_to_keep,
            )
        logits = output.logits[0]
        if batch.logits_indices.numel() == 0:
            logits = logits[:0]
        # Sample in float32 whatever the model's dtype: argmax and softmax over a
        # 49k vocabulary are both faster and better behaved there than in bfloat16.
        return logits.float()

    def close(self) -> None:
        """Give the model back its own linear maps and attention implementation (idempotent)."""
        self.fast_forward = None
        if self._packed is not None:
            self._packed.restore()
            self._packed = None
        if self._original_attention is not None:
            self.model.set_attn_implementation(self._original_attention)
            self._original_attention = None


def model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")
