"""The executor: built once per model (its device and dtype) from the chosen backends, it
runs a ``StepBatch`` to the sampled rows' float32 logits."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch

from . import attention_hook as attention
from .adapters import HFModules
from .attention_hook import ProbeRecord, attention_context
from .base import AttentionBackend, GreedyBackend, LinearBackend, ModelAdapter, model_device
from .base import model_dtype as _model_dtype
from .cpu.kernels import decode_kernel
from .cpu.prepack import PackedLinears
from .native import NativeKernels
from .registry import ROLES, BuildContext, Selection, select
from .state_mixers import StateMixers, UnsupportedStateLayer, declared_state_layers

if TYPE_CHECKING:
    from .batch import StepBatch

logger = logging.getLogger(__name__)


class Executor:
    """Owns the model's attention switch, the chosen backends and the forward call.

    On construction it switches the model to cbgen's paged attention and probes
    it with a two-token forward to learn, per attention layer, how many K/V
    heads and which head sizes it stores (read off the tensors the layer
    actually produces, so no per-architecture config keys are needed). Then it
    chooses a backend per role (``cbgen.executor.registry``), once: ``attention``
    (given to the batch builder), ``linear`` (applied to the model now),
    ``layer_ops``, ``greedy`` (the sampler's argmax) and ``model`` (the adapter
    that runs the forward). ``describe()`` says which serves each role and why
    the others refused; it is logged at INFO. ``close()`` undoes what the
    backends did and restores the model's own attention implementation.
    ``detach()`` gives the model its own module forwards and attention back but keeps
    every copy the backends made (packed weights, the fast path's plan); ``attach()``
    puts cbgen's back, with nothing rebuilt.

    ``use_native_kernels`` allows the native CPU kernels (``cbgen.executor.cpu.kernels``, loaded
    through ``kernels``); ``prepack_linear`` is ``EngineConfig.prepack_linear``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        use_native_kernels: bool = True,
        prepack_linear: bool | None = None,
        kernels: Callable[[], ModuleType | None] = decode_kernel,
    ) -> None:
        # A transformers model: its config and attention switch are not nn.Module's.
        self.model: Any = cast(Any, model)
        self.device = model_device(model)
        self.dtype = _model_dtype(model)
        self.selections: dict[str, Selection] = {}
        self._native = NativeKernels(use_native_kernels, kernels)
        self._fast: Any = None
        self._module_forward: Any = None  # HFModules(model).forward once built
        self.state_mixers: StateMixers | None = None
        # What this executor puts on the model's modules (``detach``/``attach``): each
        # module's instance forward before and after the backends were applied.
        self._forwards: list[tuple[torch.nn.Module, Any, Any]] = []
        self._detached = False
        before = _instance_forwards(model)
        attention.register()
        self._original_attention = self.model.config._attn_implementation
        self.model.set_attn_implementation(attention.ATTENTION_NAME)
        if self.model.config._attn_implementation != attention.ATTENTION_NAME:
            self.close()
            raise ValueError(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface, so cbgen cannot page its KV cache"
            )
        try:
            # Layers with a per-request state run on cbgen's slots (refused if unknown).
            self.state_mixers = StateMixers(model)
            self.probe = self._probe()
            self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
            ctx = BuildContext(model, self.probe, self._native, prepack_linear)
            for role in ROLES:
                selection = select(role, ctx, self.dtype, self.device)
                self.selections[role] = selection
                ctx.chosen[role] = selection.backend
                if selection.backend is not None:
                    selection.backend.apply(model)
            # The model's own modules, for a caller that switches the fast path off.
            self._module_forward = (
                self.adapter if isinstance(self.adapter, HFModules) else HFModules(model)
            ).forward
            self.fast_forward = getattr(self.adapter, "fast_forward", None)
            self._forwards = [
                (module, before.get(module), forward)
                for module, forward in _instance_forwards(model).items()
                if before.get(module) is not forward
            ]
        except BaseException:
            self.close()
            raise
        logger.info(
            "cbgen: executor (%s, %s): %s",
            self.device,
            str(self.dtype).removeprefix("torch."),
            "; ".join(self.describe().splitlines()),
        )

    # -- the chosen backends ------------------------------------------------------------

    def _chosen(self, role: str) -> Any:
        return self.selections[role].backend

    @property
    def attention(self) -> AttentionBackend:
        return self._chosen("attention")

    @property
    def linear(self) -> LinearBackend:
        return self._chosen("linear")

    @property
    def greedy(self) -> GreedyBackend:
        return self._chosen("greedy")

    @property
    def adapter(self) -> ModelAdapter:
        return self._chosen("model")

    @property
    def kernels(self) -> ModuleType | None:
        """The native kernel module if a backend loaded it."""
        return self._native.loaded

    def describe(self) -> str:
        """One line per role: the backend serving it and why the ones before it refused."""
        return "\n".join(self.selections[role].describe() for role in self.selections)

    @property
    def packed_linears(self) -> PackedLinears | None:
        """The prepacked (and quantized) maps serving the model's linear modules, if the
        linear backend packs them."""
        linear = self.selections.get("linear")
        return getattr(linear.backend, "packed", None) if linear is not None else None

    @property
    def prepacked_linears(self) -> int:
        """How many ``nn.Linear`` modules currently run on prepacked weights."""
        linear = self.selections.get("linear")
        backend = linear.backend if linear is not None else None
        return backend.modules_served if isinstance(backend, LinearBackend) else 0

    # -- the forward --------------------------------------------------------------------

    @property
    def fast_forward(self) -> Any:
        """The fast decoder's forward when it serves (None: the model's own modules).
        Assignable, so a test or a benchmark can switch paths on one engine."""
        return self._fast

    @fast_forward.setter
    def fast_forward(self, value: Any) -> None:
        self._fast = value
        self._forward = value if value is not None else self._module_forward

    def _probe(self) -> ProbeRecord:
        record = ProbeRecord()
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        positions = torch.arange(2, device=self.device).unsqueeze(0)
        with torch.inference_mode(), attention_context(record):
            self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
        found = len(self.state_mixers) if self.state_mixers is not None else 0
        if found:
            record.state_layers = self.state_mixers.recorded_specs()  # type: ignore[union-attr]
        declared = declared_state_layers(self.model.config)
        if found < declared:
            # The config names more stateful layers than cbgen found modules for: some
            # keep their state in a way cbgen does not see. Refuse rather than guess.
            raise UnsupportedStateLayer(
                f"{type(self.model).__name__}: its config declares {declared} layers that "
                f"keep a per-request state (layer_types) and cbgen found {found} it can run; "
                "cbgen refuses it rather than give wrong tokens"
            )
        if not record.layers and not record.state_layers:
            raise ValueError(
                f"{type(self.model).__name__} ran no attention layer through cbgen "
                "and no state layer it recognizes"
            )
        return record

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Return the float32 logits of the sampled rows, ``[samples, vocab]``."""
        with torch.inference_mode():
            return self._forward(batch)

    # -- lending the model out ----------------------------------------------------------

    def detach(self) -> None:
        """Give the model its own module forwards and attention implementation back, as
        ``close()`` does, but keep every copy made from its weights (prepacked maps, the
        fast path, the probe), so ``attach()`` serves again without rebuilding anything.
        Only valid while those weights do not change (the frozen base of LoRA training):
        the caller checks that before ``attach()`` and builds a new executor otherwise."""
        if self._detached or self._original_attention is None:
            return
        for module, previous, _ in self._forwards:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
        self.model.set_attn_implementation(self._original_attention)
        self._detached = True

    def attach(self) -> None:
        """cbgen's attention and module forwards back on the model after ``detach()``."""
        if not self._detached:
            return
        self.model.set_attn_implementation(attention.ATTENTION_NAME)
        for module, _, forward in self._forwards:
            module.__dict__["forward"] = forward
        self._detached = False

    def close(self) -> None:
        """Give the model back its own linear maps, state layers and attention implementation
        (idempotent; also after a failed construction, whose error it never hides).
        Nothing of the fast path stays referenced: its packed weights are freed."""
        self._fast = None
        self._forward = self._module_forward
        for role in reversed(list(self.selections)):
            backend = self.selections[role].backend
            if backend is not None:
                backend.close()
        if self.state_mixers is not None:
            self.state_mixers.restore()
        if self._original_attention is not None:
            self.model.set_attn_implementation(self._original_attention)
            self._original_attention = None
        self._forwards = []
        self._detached = False


def _instance_forwards(model: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    """Every module of ``model`` whose instance overrides ``forward``, and that override."""
    return {
        module: module.__dict__["forward"]
        for module in model.modules()
        if "forward" in module.__dict__
    }
