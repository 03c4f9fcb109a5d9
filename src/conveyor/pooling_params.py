"""How an embedding request pools its prompt's hidden states, as vLLM's PoolingParams.

A request whose `SamplingParams.pooling` is set samples nothing: the engine runs its prompt
(in chunks, batched with everyone else's steps) and returns one vector, the pooled final
hidden states (after the model's final norm) of its prompt tokens:

    last: the hidden state of the last prompt token (decoder embedding models: Qwen3-Embedding,
          e5-mistral, gte-Qwen2); needs the last chunk's final row only
    mean: the mean over every prompt token; accumulated chunk by chunk

`dimensions` (Matryoshka models only, checked by the engine against the checkpoint) keeps the
first `dimensions` values before normalizing; `normalize` divides by the L2 norm.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.validation import check_choice, check_positive_int

POOLING_TYPES = ("last", "mean")


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """Args:
    pooling_type: "last" or "mean"; None: the model's (its sentence-transformers config, the
        engine's `pooling_type`, else "last"). The engine fills it in when the request joins.
    normalize: L2-normalize the vector (OpenAI's embeddings are unit vectors).
    dimensions: keep only the first this many values (Matryoshka models); None: all.
    """

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            check_choice("pooling_type", self.pooling_type, POOLING_TYPES)
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")
        if self.dimensions is not None:
            check_positive_int("dimensions", self.dimensions)
