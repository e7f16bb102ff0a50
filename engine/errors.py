"""Refusals the engine adds to the scheduler's: request fields checked against the model.

Like the scheduler's errors they carry facts and name the field in the engine's
terms (`SamplingParams` and prompt field names); the server words its replies.
"""

from __future__ import annotations

from scheduler import RequestRejectedError


class InvalidParameterError(RequestRejectedError):
    """A request field outside its domain.

    `problem` completes a sentence that starts with the field's name, e.g.
    "must be in (0, 1], got 1.5", so a front end can name the field its own way.
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}", field=field)
        self.problem = problem


class TokenIdOutOfVocabularyError(RequestRejectedError):
    """A token id (in the prompt, in logit_bias, ...) that the model does not have."""

    def __init__(self, field: str, token_id: int, vocab_size: int):
        super().__init__(f"{field}: token id {token_id} is outside the vocabulary (0..{vocab_size - 1})", field=field)
        self.token_id = token_id
        self.vocab_size = vocab_size


class SettingsConflictError(ValueError):
    """Settings that cannot run together, or not on this machine (an attention backend, a KV-cache dtype, a
    quantization, batch invariance): a fault of the settings, not of the model, so `pagedserve serve` exits
    with status 2 as for any bad flag."""


class LoRANotFoundError(RequestRejectedError):
    """A request (or an unload) named an adapter that is not registered: an unknown model, 404."""

    def __init__(self, name: str):
        super().__init__(f"LoRA adapter {name!r} is not loaded", field="model")
        self.name = name


class LoRARankError(InvalidParameterError):
    """An adapter whose rank exceeds max_lora_rank (400)."""

    def __init__(self, name: str, rank: int, max_rank: int):
        super().__init__("lora", f"adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}")
        self.name = name
        self.rank = rank
        self.max_rank = max_rank


class LoRAAdapterError(InvalidParameterError):
    """An adapter directory the engine cannot serve (DoRA, an unsupported target, a missing file): 400."""

    def __init__(self, name: str, problem: str):
        super().__init__("lora", f"adapter {name!r}: {problem}")
        self.name = name
