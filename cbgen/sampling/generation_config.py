"""``transformers.GenerationConfig`` -> ``SamplingParams`` keyword arguments.

Every field a generation config can set is either translated, known not to change the
tokens (caching, compilation, ids of special tokens), or refused with a ``ValueError``
that names it: a setting dropped in silence would give other tokens than
``model.generate()`` with the same config and no hint why.
"""

from __future__ import annotations

from typing import Any

# Fields whose value at these settings changes nothing; anything else is unsupported.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "diversity_penalty": (0.0,),
    "penalty_alpha": (0.0,),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "top_h": (),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "encoder_repetition_penalty": (1.0,),
    "force_words_ids": (),
    "constraints": (),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "begin_suppress_tokens": (),
    "exponential_decay_length_penalty": (),
    "guidance_scale": (1.0,),
    "watermarking_config": (),
    "dola_layers": (),
    "prompt_lookup_num_tokens": (),
    "token_healing": (False,),
    "max_time": (),
    "min_length": (0,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "output_scores": (False,),
    "output_logits": (False,),
    "use_mtp": (False,),
}

_HINTS = {
    "min_length": "it counts the prompt; use min_new_tokens",
    "output_scores": "use SamplingParams(logprobs=N)",
    "output_logits": "use SamplingParams(logprobs=N)",
    "num_beams": "cbgen samples or decodes greedily; beam search is not supported",
}


def sampling_kwargs(gc: Any) -> dict[str, Any]:
    """The ``SamplingParams`` keyword arguments equivalent to generation config ``gc``."""
    _refuse_unsupported(gc)
    eos = gc.eos_token_id
    kwargs: dict[str, Any] = {
        "max_new_tokens": gc.max_new_tokens if gc.max_new_tokens is not None else 20,
        "eos_token_ids": () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
        "n": getattr(gc, "num_return_sequences", None) or 1,
        "repetition_penalty": 1.0
        if gc.repetition_penalty is None
        else float(gc.repetition_penalty),
        "min_tokens": gc.min_new_tokens or 0,
        "bad_words": _bad_words(gc),
    }
    if gc.stop_strings:
        kwargs["stop"] = (
            [gc.stop_strings] if isinstance(gc.stop_strings, str) else list(gc.stop_strings)
        )
    bias = _logit_bias(gc.sequence_bias)
    if bias:
        kwargs["logit_bias"] = bias
    if gc.do_sample:
        kwargs.update(
            temperature=1.0 if gc.temperature is None else float(gc.temperature),
            top_k=0 if gc.top_k is None else int(gc.top_k),
            top_p=1.0 if gc.top_p is None else float(gc.top_p),
            min_p=0.0 if gc.min_p is None else float(gc.min_p),
        )
    return kwargs


def _refuse_unsupported(gc: Any) -> None:
    unsupported = []
    for name, neutral in _NEUTRAL.items():
        value = getattr(gc, name, None)
        if value is None or value in neutral:
            continue
        hint = _HINTS.get(name)
        unsupported.append(f"{name}={value!r}" + (f" ({hint})" if hint else ""))
    if unsupported:
        raise ValueError(
            "this GenerationConfig sets what cbgen does not support: " + ", ".join(unsupported)
        )


def _bad_words(gc: Any) -> tuple[tuple[int, ...], ...]:
    words = [tuple(w) for w in gc.bad_words_ids or ()]
    # transformers' SuppressTokensLogitsProcessor bans these ids at every step.
    words += [(int(t),) for t in gc.suppress_tokens or ()]
    return tuple(words)


def _logit_bias(sequence_bias: Any) -> dict[int, float]:
    """transformers' ``sequence_bias`` for single tokens is a logit bias; a longer
    sequence's bias depends on the tokens before it, which cbgen does not model."""
    if not sequence_bias:
        return {}
    items = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
    bias: dict[int, float] = {}
    for key, value in items:
        tokens = tuple(key)
        if len(tokens) != 1:
            raise ValueError(
                f"sequence_bias for the sequence {list(tokens)} is not supported "
                "(cbgen biases single tokens: use one-token keys, or SamplingParams.logit_bias)"
            )
        bias[int(tokens[0])] = bias.get(int(tokens[0]), 0.0) + float(value)
    return bias
