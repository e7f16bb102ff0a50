"""Where another rank reads an adapter: what a request's adapters become in the step message to worker ranks.

Rank 0's manager reads and checks every adapter before any request names it (a bad directory is refused there,
as with one process). The step message then carries each adapter's source, not its weights: a worker rank reads
the same directory (the same filesystem, like the model's weights) when one of its slots first takes the adapter,
and keeps only its part (engine/lora_shard.py). The content hash rank 0 read is checked, so a file changed
since can never give a rank other weights than rank 0's.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.errors import LoRAAdapterError
from engine.lora.adapter_layout import AdapterLayout
from engine.lora.gguf_adapter import GgufTarget, is_gguf_adapter, load_gguf_adapter
from engine.lora.peft_adapter import LoRAWeights, load_peft_adapter


class AdapterSource(NamedTuple):
    name: str
    path: str
    content_hash: bytes  # of the files rank 0 read (peft_adapter.load_peft_adapter)

    @classmethod
    def of(cls, weights: LoRAWeights) -> "AdapterSource":
        return cls(weights.name, weights.path, weights.content_hash)


def read_source(
    source: AdapterSource, max_rank: int, num_layers: int, target: GgufTarget, layout: AdapterLayout
) -> LoRAWeights:
    """The whole adapter at `source` (a PEFT directory mapped by the family's `layout`, or a llama.cpp GGUF file
    read against the whole model's `target`), as rank 0 read it; LoRAAdapterError when it cannot be read or its
    files changed since."""
    if is_gguf_adapter(source.path):
        weights = load_gguf_adapter(source.name, source.path, max_rank, num_layers, target)
    else:
        weights = load_peft_adapter(source.name, source.path, max_rank, num_layers, layout)
    if weights.content_hash != source.content_hash:
        raise LoRAAdapterError(source.name, f"the files in {source.path!r} changed after the engine loaded them")
    return weights
