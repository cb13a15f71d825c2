"""Turn the step's logits into one token per sampled request, for the whole batch at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .grammar import apply_bitmask
from .logits import BatchLogitsProcessor, LogitsRows, apply_processors
from .logprobs import TokenLogprobs, token_logprobs
from .params import SamplingParams


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy choice on any device; the executor may hand the sampler a faster one."""
    return torch.argmax(logits, dim=-1)


@dataclass
class SamplerOutput:
    """One token per row; ``errors`` maps a row whose logits processor failed to why
    (its token is meaningless). ``logprobs``: per row, the sampled token's logprob and
    the top ones its request asked for (``None`` for a row that asked for none, and
    the whole list ``None`` when no row did)."""

    tokens: list[int]
    errors: dict[int, str] = field(default_factory=dict)
    token_tensor: torch.Tensor | None = None  # the same ids, on the device
    logprobs: list[TokenLogprobs | None] | None = None
    # Filled by the engine: per request id, the first prompt position scored and the
    # logprobs there (``SamplingParams.prompt_logprobs``).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None


class Sampler:
    """Greedy rows take an argmax; the other rows go through one fused pass.

    First the batch logits processors (``cbgen.sampling.logits``: penalties, biases, bans) and
    the per-request processors change the rows that ask for them; logprobs are taken
    before that, from the raw logits. The fused pass scales by temperature, sorts once
    (only when a row has top-k or top-p), masks top-k, top-p and min-p in the sorted
    order, and draws by inverse CDF: one
    uniform per row against the row's cumulative probabilities. One number per row
    lets each seeded request use its own generator cheaply; the exponential race used
    before (``argmax(p / E)``, a noise vector per row) cost 73 ms a step at 64 rows of
    49k logits against 3 ms now (over a quarter of the serving loop's time in a profile).
    """

    def __init__(
        self,
        generator: torch.Generator | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        processors: Sequence[BatchLogitsProcessor] = (),
    ) -> None:
        """``argmax``: ``torch.argmax(logits, dim=-1)`` as the engine's greedy backend
        computes it (``cbgen.executor.greedy``: the native ``argmax_rows`` for the float32
        CPU logits of a CPU engine); default ``torch.argmax``. ``processors``: the batch
        logits processors, in order (``cbgen.sampling.logits.default_processors``)."""
        self.generator = generator
        self._argmax = argmax or torch_argmax
        self.processors = list(processors)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[list[int] | None] | None = None,
        state: LogitsRows | None = None,
        bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """``histories`` (each row's token ids so far) feed the rows' per-request logits
        processors; ``state`` is what the batch processors read (needed when a row uses one);
        ``bitmask`` is the allowed tokens of the grammar rows and those rows' indices
        (``cbgen.sampling.grammar``), applied after every processor."""
        if logits.shape[0] == 0:
            return SamplerOutput([])
        errors: dict[int, str] = {}
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            index = torch.tensor(logprob_rows, device=logits.device)
            # A new tensor either way: the processors below change ``logits`` in place.
            every_row = len(logprob_rows) == len(params)
            raw_logprobs = torch.log_softmax(
                logits if every_row else logits.index_select(0, index), dim=-1
            )
        if state is not None and self.processors:
            apply_processors(self.processors, logits, state)
        if any(p.logits_processors for p in params):
            errors = _apply_processors(logits, params, histories)
        if bitmask is not None:
            apply_bitmask(logits, bitmask[0], bitmask[1])
        tokens = self._argmax(logits)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        rows = selected = None
        if sampled_rows:
            rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
            selected = logits.index_select(0, rows)
            drawn = self._sample_isolated(
                selected,
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
                sampled_rows,
                errors,
            )
            tokens.index_copy_(0, rows, drawn)
        _check_finite(logits, tokens, rows, selected, errors)
        out = SamplerOutput(tokens.tolist(), errors, tokens)
        if raw_logprobs is not None:
            out.logprobs = [None] * len(params)
            counts = [params[i].logprobs or 0 for i in logprob_rows]
            chosen = tokens.index_select(0, index)
            entries = token_logprobs(raw_logprobs, chosen, counts)
            for i, entry in zip(logprob_rows, entries, strict=True):
                out.logprobs[i] = entry
        return out

    def _uniforms(
        self, generators: list[torch.Generator | None], device: torch.device
    ) -> torch.Tensor:
        """One uniform in [0, 1) per row: seeded rows from their own generator, the others
        in one draw from the sampler's."""
        u = torch.empty(len(generators), device=device)
        shared = [row for row, gen in enumerate(generators) if gen is None]
        if shared:
            rows = torch.tensor(shared, dtype=torch.long, device=device)
            u.index_copy_(0, rows, torch.rand(len(shared), generator=self.generator, device=device))
        for row, gen in enumerate(generators):
            if gen is not None:
                u[row] = torch.rand((), generator=gen, device=device)
        return u

    def _sample_isolated(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[int],
        errors: dict[int, str],
    ) -> torch.Tensor:
        """``_sample`` for the whole batch; if it raises, again row by row, so that only
        the rows that fail on their own finish with an error (their token is 0)."""
        try:
            return self._sample(logits, params, generators)
        except Exception:
            pass
        drawn = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        for i, row in enumerate(rows):
            try:
                drawn[i] = self._sample(logits[i : i + 1], [params[i]], [generators[i]])[0]
            except Exception as exc:
                errors.setdefault(row, f"sampling failed: {type(exc).__name__}: {exc}")
        return drawn

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits.float() / temperature.unsqueeze(1)
        needs_filter = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        if needs_filter:
            scaled, order = torch.sort(scaled, dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
            scaled = scaled.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
            top_p = torch.tensor([p.top_p for p in params], device=device)
            probs = torch.softmax(scaled, dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            # The most likely token always survives, whatever top_p says.
            scaled = scaled.masked_fill(mass_before > top_p.unsqueeze(1), float("-inf"))
            # min_p: less likely than min_p times the top token (column 0 once sorted);
            # a ratio of probabilities, so the same before or after top-k / top-p.
            min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            scaled = scaled.masked_fill(scaled < scaled[:, :1] + torch.log(min_p), float("-inf"))
        cdf = torch.cumsum(torch.softmax(scaled, dim=-1), dim=-1)
        target = self._uniforms(generators, device) * cdf[:, -1]
        # The first token whose cumulative mass passes the target: token i is drawn with
        # probability p_i, and a masked token (p = 0) never, since the sum stays flat there.
        choice = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
        choice.clamp_(max=vocab - 1)  # a target rounded up to the total
        if needs_filter:
            choice = order.gather(1, choice.unsqueeze(1)).squeeze(1)
        return choice


def _apply_processors(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: Sequence[list[int] | None] | None,
) -> dict[int, str]:
    """Run each row's logits processors in place; a failing row is reported, not raised.

    A failed row's logits become a harmless finite row so the batched sampling
    below cannot trip over what the processor left behind.
    """
    if histories is None:
        raise ValueError("logits processors need the rows' token histories")
    errors: dict[int, str] = {}
    for row, p in enumerate(params):
        if not p.logits_processors:
            continue
        values = logits[row]
        try:
            for processor in p.logits_processors:
                values = processor(histories[row] or [], values)
                if not isinstance(values, torch.Tensor) or values.shape != logits[row].shape:
                    raise ValueError(
                        f"returned {type(values).__name__} "
                        f"{tuple(getattr(values, 'shape', ()))}, expected a tensor of shape "
                        f"{tuple(logits[row].shape)}"
                    )
            logits[row] = values
        except Exception as exc:
            errors[row] = f"logits processor {processor!r} failed: {type(exc).__name__}: {exc}"
            logits[row] = 0.0
    return errors


def _check_finite(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor | None,
    selected: torch.Tensor | None,
    errors: dict[int, str],
) -> None:
    """Report rows whose logits hold no usable number (a NaN, or no finite maximum).

    For greedy rows the chosen token's logit tells: argmax picks the first NaN when there
    is one (torch's rule and the native kernel's), and a row of infinities gives an
    infinite choice. A sampled row's NaN makes its whole softmax NaN and its draw
    arbitrary, so its maximum is checked instead (which propagates NaN). ``rows`` are the
    sampled rows and ``selected`` their logits, already gathered for sampling.
    """
    values = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if rows is not None and selected is not None:
        values = values.index_copy(0, rows, selected.amax(dim=-1))
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    for row in bad.nonzero().flatten().tolist():
        errors.setdefault(row, f"the model produced non-finite logits ({values[row].item()})")
