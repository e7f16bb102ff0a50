"""The offline API's pooling calls (`LLM.embed`, `LLM.classify`, `LLM.score`, vLLM's): prompts queued as pooling
requests, the engine stepped until each has its one output."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from tqdm.auto import tqdm

from engine.engine import EngineCore
from engine.lora.request import LoRAMix, LoRARequest
from engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling.params import PoolingParams
from engine.pooling.scoring import cosine, pair_up
from engine.prompt_inputs import PromptType, as_prompt_list

LoRAChoice = Union[LoRARequest, LoRAMix, None]


def pool_prompts(
    engine: EngineCore,
    request_ids: list[str],
    prompts: list[list[int]],
    params: Sequence[PoolingParams],
    loras: Sequence[Optional[LoRAMix]],
    salts: Sequence[Optional[str]],
    use_tqdm: bool,
    desc: str,
) -> list[RequestOutput]:
    """Each prompt's final output (its `embedding`: the pooled vector), in input order; a prompt that fails is a
    RuntimeError naming it, and every request of the call still running is aborted."""
    index = {request_id: i for i, request_id in enumerate(request_ids)}
    done: dict[str, RequestOutput] = {}
    try:
        for request_id, token_ids, own, lora, salt in zip(request_ids, prompts, params, loras, salts):
            engine.add_request(request_id, token_ids, own, lora=lora, cache_salt=salt)
        with tqdm(total=len(request_ids), desc=desc, unit="prompt", disable=not use_tqdm) as bar:
            while engine.has_work:
                for out in engine.step():
                    if out.request_id not in index or not out.finished:
                        continue
                    if out.embedding is None:
                        raise RuntimeError(f"prompt {index[out.request_id]} was not pooled: {out.error}")
                    done[out.request_id] = out
                    bar.update(1)
    except BaseException:
        engine.abort([request_id for request_id in request_ids if request_id not in done])
        raise
    return [done[request_id] for request_id in request_ids]


def pooling_params_list(params: Union[PoolingParams, Sequence[PoolingParams], None], count: int) -> list[PoolingParams]:
    """One PoolingParams per prompt (vLLM's: one for all, or a list of one per prompt; None: the defaults)."""
    if params is None:
        return [PoolingParams()] * count
    if isinstance(params, PoolingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, (str, dict)):
        raise TypeError(f"pooling_params must be a PoolingParams or a list of them, not {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} PoolingParams for {count} prompts")
    bad = next((p for p in params if not isinstance(p, PoolingParams)), None)
    if bad is not None:
        raise TypeError(f"pooling_params must be PoolingParams, not {type(bad).__name__}")
    return params


class PoolingCalls:
    """The LLM's calls on a pooling model (a base of engine/llm.py's LLM, which holds the engine and encodes the
    prompts)."""

    if TYPE_CHECKING:
        engine: EngineCore
        _ids: Iterator[int]

        def _encode(self, prompt: PromptType) -> tuple[Optional[str], list[int]]: ...

        def _as_lora_list(self, choice: Any, count: int) -> list[Optional[LoRAMix]]: ...

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRAChoice, Sequence[LoRAChoice]] = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (`outputs.embedding`), in input order, from a model served
        for pooling (`LLM(model, runner="pooling")`, or a checkpoint whose architecture names a base model).
        `pooling_params`: one for every prompt, or a list of one per prompt; `truncate_prompt_tokens` keeps each
        prompt's last that many tokens (-1: as many as the context holds)."""
        finals, encoded = self._pool("embed", prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request)
        return [
            EmbeddingRequestOutput(
                out.request_id, EmbeddingOutput(out.embedding or []), ids, num_cached_tokens=out.num_cached_tokens
            )
            for out, ids in zip(finals, encoded)
        ]

    def classify(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRAChoice, Sequence[LoRAChoice]] = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's class probabilities (`outputs.probs`, one per label of the model's
        id2label), in input order, from a sequence classification model (a "...ForSequenceClassification"
        checkpoint, or `convert="classify"`)."""
        finals, encoded = self._pool(
            "classify", prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request
        )
        return [
            ClassificationRequestOutput(out.request_id, ClassificationOutput(out.embedding or []), ids)
            for out, ids in zip(finals, encoded)
        ]

    def score(
        self,
        data_1: Union[str, Sequence[str]],
        data_2: Union[str, Sequence[str]],
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[PoolingParams] = None,
        lora_request: Union[LoRAChoice, Sequence[LoRAChoice]] = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: `data_1` against each of `data_2` (or pairwise, two lists of one length), each
        pair's `outputs.score`: a one-label classifier's score of the pair tokenized together (a cross-encoder
        reranker), or an embedding model's cosine of the two texts' embeddings (each distinct text embedded once)."""
        pairs = pair_up(data_1, data_2)
        pooler = self.engine.pooler
        if pooler is not None and pooler.task == "classify":
            if len(pooler.labels) != 1:
                raise ValueError(f"score() takes a classifier with one label; this one has {len(pooler.labels)}")
            tokenizer = self.engine.tokenizer.hf
            keep = self._kept_tokens(truncate_prompt_tokens)  # (a pair keeps its first tokens: the query's)
            joined = [{"prompt_token_ids": tokenizer(text=a, text_pair=b)["input_ids"][:keep]} for a, b in pairs]
            finals, encoded = self._pool("classify", joined, pooling_params, None, use_tqdm, lora_request)
            return [
                ScoringRequestOutput(out.request_id, ScoringOutput((out.embedding or [0.0])[0]), ids)
                for out, ids in zip(finals, encoded)
            ]
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        finals, encoded = self._pool("embed", texts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request)
        vectors = {text: (out.embedding or [], ids) for text, out, ids in zip(texts, finals, encoded)}
        return [
            ScoringRequestOutput(
                f"score-{next(self._ids)}", ScoringOutput(cosine(vectors[a][0], vectors[b][0])), vectors[b][1]
            )
            for a, b in pairs
        ]

    def _kept_tokens(self, truncate_prompt_tokens: Optional[int]) -> Optional[int]:
        """vLLM's truncate_prompt_tokens as a count (-1: as many as the context holds; None: no truncation)."""
        if truncate_prompt_tokens == -1:
            return self.engine.max_model_len
        if truncate_prompt_tokens is not None and truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {truncate_prompt_tokens}"
            )
        return truncate_prompt_tokens

    def _pool(
        self,
        task: str,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None],
        truncate_prompt_tokens: Optional[int],
        use_tqdm: bool,
        lora_request: Union[LoRAChoice, Sequence[LoRAChoice]],
    ) -> tuple[list[RequestOutput], list[list[int]]]:
        pooler = self.engine.pooler
        if pooler is None or pooler.task != task:
            what = "a generative" if pooler is None else f"a {pooler.task}"
            raise ValueError(f"{task}() needs a pooling model that does {task}: this is {what} model")
        prompt_list = as_prompt_list(prompts)
        params = pooling_params_list(pooling_params, len(prompt_list))
        encoded = [self._encode(p)[1] for p in prompt_list]
        keep = self._kept_tokens(truncate_prompt_tokens)
        if keep is not None:
            encoded = [ids[-keep:] for ids in encoded]
        loras = self._as_lora_list(lora_request, len(encoded))
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompt_list]
        ids = [f"{task}-{next(self._ids)}" for _ in encoded]
        desc = "embedding" if task == "embed" else "classifying"
        finals = pool_prompts(self.engine, ids, encoded, params, loras, salts, use_tqdm, desc)
        return finals, encoded
