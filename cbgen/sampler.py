"""Turn the step's logits into one token per sampled request, for the whole batch at once."""

from __future__ import annotations

import torch

from .sampling import SamplingParams


class Sampler:
    """Greedy rows take an argmax; the other rows go through one fused pass.

    The fused pass scales by temperature, sorts once, masks top-k and top-p in
    the sorted order, and draws with the exponential-race trick
    (``argmax(p / E)`` with ``E ~ Exp(1)``), which needs one noise vector per row
    and so lets each seeded request use its own generator.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        if logits.shape[0] == 0:
            return []
        tokens = torch.argmax(logits, dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
            drawn = self._sample(
                logits.index_select(0, rows),
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
            tokens.index_copy_(0, rows, drawn)
        return tokens.tolist()

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
        needs_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
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
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for row, gen in enumerate(generators):
            noise[row].exponential_(generator=gen if gen is not None else self.generator)
        choice = torch.argmax(probs / noise, dim=-1)
        if needs_filter:
            choice = order.gather(1, choice.unsqueeze(1)).squeeze(1)
        return choice
