"""The offline API's pooling run (`LLM.embed`, `LLM.classify`): prompts queued as pooling requests, the engine
stepped until each has its one output."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from engine.engine import EngineCore
from engine.lora.request import LoRAMix
from engine.outputs import RequestOutput
from engine.pooling.params import PoolingParams


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
