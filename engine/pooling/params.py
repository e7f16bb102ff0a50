"""What a pooling request asks for (vLLM's PoolingParams), and what the runner pools it with."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from engine.errors import InvalidParameterError


class PoolingType(str, enum.Enum):
    """How a prompt's final hidden states become one vector (vLLM's names)."""

    LAST = "LAST"  # the last token's (a decoder's embedding: it has attended to every other token)
    MEAN = "MEAN"  # the mean over every prompt token
    CLS = "CLS"  # the first token's


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """A pooling request's own settings, as vLLM's `PoolingParams`: `dimensions` keeps the first that many
    components (a Matryoshka model's shorter embedding; None: all of them); `normalize` scales the vector to unit
    length (None: the model's pooler decides); `use_activation` (a classification model's) turns its logits into
    probabilities (None or True: the model's activation; False: the raw logits)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    use_activation: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise InvalidParameterError("dimensions", f"must be an integer, got {self.dimensions!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidParameterError("dimensions", f"must be at least 1, got {self.dimensions}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidParameterError(name, f"must be true or false, got {value!r}")


@dataclass(frozen=True, slots=True)
class Pooling:
    """A pooling request as the runner takes it (in the step message, as `sampling_params`): the model's pooling
    type, and the request's settings resolved against the model's defaults."""

    type: PoolingType
    normalize: bool
    dimensions: Optional[int] = None  # None: the whole hidden state
    # A classification model's: its logits (the classifier over the pooled state) through `activation`
    # ("sigmoid", "softmax"; None: the raw logits)
    classify: bool = False
    activation: Optional[str] = None
