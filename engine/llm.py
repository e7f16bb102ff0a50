"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, vLLM-style."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Sequence, Union

from pydantic import BaseModel
from tqdm.auto import tqdm

from engine.sampling.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.builder import build_engine
from engine.cache_config import EngineCacheConfig
from engine.distributed.parallel_config import ParallelConfig
from engine.loading.model_config import ModelConfig
from engine.lora.lora_config import LoRAConfig
from engine.lora.request import LoRAMix, LoRARequest
from engine.engine import EngineCore
from engine.engine_config import EngineConfig
from engine.llm_pooling import LoRAChoice, PoolingCalls
from engine.prompt_inputs import EncodedPrompt, PromptType, as_prompt_list, chat_messages, token_ids_of
from engine.outputs import (
    CompletionOutput,
    GenerationResult,
    OutputAccumulator,
    PositionLogprobs,
    prompt_logprobs,
)
from engine.sampling.parallel import fan_out
from engine.sampling.params import SamplingParams
from engine.multimodal.images import offline_image, pil_images
from engine.text.chat_content_format import detect_content_format
from engine.text.tokenizer import TEMPLATE_RENDERER_ARGUMENTS, Tokenizer
from scheduler import SchedulerConfig

if TYPE_CHECKING:
    from typing_extensions import TypeIs

_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": EngineCacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}


# vLLM's settings of what this engine always does: taken when they ask for that (vLLM scripts pass them; None is
# vLLM's default, so it is taken too), a ValueError when they ask for something else
_ALWAYS: dict[str, tuple[Optional[tuple[Any, ...]], str]] = {
    "enable_chunked_prefill": ((True,), "this engine always chunks long prefills"),
    "tokenizer_mode": (("auto",), "the tokenizer is always the checkpoint's fast (Rust) one"),
    "disable_log_stats": ((True,), "the offline engine logs no periodic statistics"),
    "skip_tokenizer_init": ((False,), "the engine always loads the tokenizer (it detokenizes and stops on strings)"),
    "tokenizer_revision": ((), "the tokenizer is read at the model's revision"),
    "cpu_offload_gb": ((0,), "weights are not offloaded to the CPU"),
    "load_format": (("auto",), "weights load from what the checkpoint holds (safetensors, GGUF)"),
    "logprobs_mode": (("raw_logprobs",), "logprobs are the model's, before any penalty or temperature"),
    "disable_sliding_window": ((False,), "a model's sliding window is always kept"),
    "enable_sleep_mode": ((False,), "the engine has no sleep mode"),
    "data_parallel_size": ((1,), "one engine per process (run a server per replica)"),
    "expert_placement_strategy": (("linear",), "each rank holds a contiguous run of experts"),
    "enable_eplb": ((False,), "experts are not rebalanced between ranks"),
    "calculate_kv_scales": ((False,), "fp8 K/V are stored unscaled"),
    "compilation_config": ((0, {}), "the model is not compiled (CUDA graphs: enforce_eager)"),
    # (None: any value is what this engine does)
    "disable_custom_all_reduce": (None, "there is no custom CUDA all-reduce to turn off"),
    "served_model_name": (None, "the name vLLM's server shows; the offline API shows none"),
}
# vLLM's names of this engine's settings
_ALIASES = {
    "scheduling_policy": "policy",
    "num_gpu_blocks_override": "num_blocks",
    "override_pooler_config": "pooler_config",
}
# vLLM's older `task`, as the runner (and conversion) it chose
_TASK_RUNNERS = {
    "auto": "auto",
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "classify": "pooling",
    "score": "pooling",  # (a cross-encoder classifies, another model embeds: the checkpoint's architecture says)
}


def engine_config_from_kwargs(model: Optional[str], **kwargs: Any) -> EngineConfig:
    """Route flat keyword arguments (vLLM's names) to the config section that owns them."""
    sections: dict[str, dict] = {name: {} for name in _SECTIONS}
    sections["model"]["model"] = model
    top: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in _ALWAYS:
            wanted, what = _ALWAYS[key]
            if value is not None and wanted is not None and value not in wanted:
                raise ValueError(f"LLM({key}={value!r}): {what}")
            continue
        if key in (
            "attention_backend",
            "batch_invariant",
            "cpu_threads",
            "enforce_eager",
            "profile",
            "speculative_config",
        ):
            top[key] = value
            continue
        if key == "task":
            if value is not None and value not in _TASK_RUNNERS:
                raise ValueError(f"LLM(task={value!r}): served tasks are {', '.join(_TASK_RUNNERS)}")
            if value is not None and value != "auto":
                sections["model"].setdefault("runner", _TASK_RUNNERS[value])
            if value == "classify":
                sections["model"].setdefault("convert", "classify")
            continue
        key = _ALIASES.get(key, key)
        if key == "kv_offloading_size":  # vLLM's newer name of swap_space (as the server's flag)
            if "swap_space" in kwargs:
                raise TypeError("LLM() got both swap_space and kv_offloading_size (one setting, two names)")
            key = "swap_space"
        owner = next((name for name, cls in _SECTIONS.items() if key in cls.model_fields), None)
        if owner is None:
            raise TypeError(f"LLM() got an unknown argument {key!r}")
        if value is not None:  # (None: the default, as vLLM's arguments take it)
            sections[owner][key] = value
    return EngineConfig(**{name: cls(**sections[name]) for name, cls in _SECTIONS.items()}, **top)


class LLM(PoolingCalls):
    """Load a model once, then generate for batches of prompts.

    >>> llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        self.engine: EngineCore = build_engine(engine_config_from_kwargs(model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the KV cache, the CUDA graphs and the weights now (also what leaving `with LLM(...)`
        does); the LLM generates nothing after. Dropping the last reference frees the same memory."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def llm_engine(self) -> EngineCore:
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams (vLLM's method): SamplingParams'
        defaults, but for the model's own (its generation_config.json's repetition_penalty, temperature, top_k,
        top_p and min_p, unless made with generation_config="vllm")."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Union[LoRAChoice, Sequence[LoRAChoice]] = None,
    ) -> list[GenerationResult]:
        """Complete each prompt (a string, a list of token ids, or a dict of "prompt" or "prompt_token_ids" and
        optionally vLLM's "cache_salt": only prompts of the same salt share cached blocks, and, for a
        vision-language model, vLLM's "multi_modal_data": {"image": a PIL image or a list}, one per placeholder the
        "prompt" writes); results come back in input order. `priority` (one per prompt, lower first) needs the
        priority scheduling policy, as in vLLM. `lora_request`: the adapter for every prompt or one per
        prompt (a LoRARequest, registered on first use; a LoRAMix of registered adapters; None: the base)."""
        prompt_list = as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list), self.get_default_sampling_params)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        if priority is not None and any(priority) and self.engine.scheduler.scheduler_config.policy != "priority":
            raise ValueError("priority needs an LLM made with scheduling_policy='priority' (as in vLLM)")
        loras = self._as_lora_list(lora_request, len(prompt_list))
        encoded = [self._encode_with_images(p) for p in prompt_list]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompt_list]
        return self._run(encoded, params_list, use_tqdm, priority, loras, salts)

    def _as_lora_list(self, choice: Union[LoRAChoice, Sequence[LoRAChoice]], count: int) -> list[Optional[LoRAMix]]:
        """One LoRAMix (or None) per prompt; LoRARequests are loaded first (idempotent by name)."""
        if choice is None or isinstance(choice, (LoRARequest, LoRAMix)):
            choices: list[LoRAChoice] = [choice] * count
        else:
            choices = list(choice)
            if len(choices) != count:
                raise ValueError(f"got {len(choices)} LoRA requests for {count} prompts")
        mixes: list[Optional[LoRAMix]] = []
        for item in choices:
            if isinstance(item, LoRARequest):
                manager = self.engine.lora_manager
                if manager is None:
                    raise ValueError("lora_request needs LLM(..., enable_lora=True)")
                manager.add_lora(item)
                item = LoRAMix.single(item.name)
            mixes.append(item)
        return mixes

    def chat(
        self,
        messages: Union[list[dict], Sequence[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: Union[LoRAChoice, Sequence[LoRAChoice]] = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: Literal["auto", "string", "openai"] = "auto",
        continue_final_message: bool = False,
        tools: Optional[list[dict]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[GenerationResult]:
        """Generate replies to one conversation or a list of them, using the model's chat template (or
        `chat_template`, Jinja text). A message's content is a string or OpenAI's text parts (`[{"type": "text",
        "text": ...}]`), which reach the template as vLLM's `chat_template_content_format` says: `string` joins
        the parts by newlines, `openai` gives a list of parts (a string as one), `auto` reads which from the
        template, as the server does. `continue_final_message`, `tools` and `chat_template_kwargs` as the chat
        route takes them; `lora_request` as for `generate`. A vision-language model also reads image parts:
        `{"type": "image_url", "image_url": {"url": ...}}` with a data: URL (or a file:// URL under
        allowed_local_media_path), or vLLM's `{"type": "image_pil", "image_pil": <PIL image>}`."""
        if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
            raise TypeError("chat() takes a conversation (a list of message dicts) or a list of conversations")
        conversations = [messages] if _is_conversation(messages) else list(messages)
        clashing = sorted(set(chat_template_kwargs or {}) & TEMPLATE_RENDERER_ARGUMENTS)
        if clashing:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(clashing)}: the renderer's own arguments")
        tokenizer = self.engine.tokenizer
        template = chat_template if chat_template is not None else tokenizer.chat_template_text(tools)
        content_format = chat_template_content_format
        if content_format == "auto":
            content_format = detect_content_format(template) if template is not None else "string"
        processor = self.engine.processor
        placeholder = None if processor is None else processor.image_placeholder
        encoded = []
        for conversation in conversations:
            messages, parts = chat_messages(conversation, content_format, placeholder)
            text = tokenizer.render_chat(
                messages,
                add_generation_prompt,
                tools,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                chat_template=chat_template,
            )
            if processor is None:  # (a text model's chat_messages refused image parts)
                encoded.append(EncodedPrompt(text, tokenizer.encode(text, add_special_tokens=False)))
                continue
            allowed = self.engine.config.model.media_path
            images = [offline_image(part.kind, part.source, allowed, f"{where}.{part.kind}") for where, part in parts]
            encoded.append(EncodedPrompt(text, *processor.process(text, images, param="messages")))
        loras = self._as_lora_list(lora_request, len(encoded))
        params_list = _as_params_list(sampling_params, len(encoded), self.get_default_sampling_params)
        return self._run(encoded, params_list, use_tqdm, loras=loras)

    def beam_search(
        self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `beam_width` best beams (engine/sampling/beam_search.py), best
        first, in input order. The prompts' searches step together: one engine step computes every live beam's next
        token."""
        searches = []
        for prompt in as_prompt_list(prompts):
            token_ids = self._encode(prompt)[1]
            # (the context as far as the KV cache holds it, as for max_tokens None; no room: the step refuses it)
            room = max(self.engine.max_sequence_len - len(token_ids), 1)
            searches.append(BeamSearch(token_ids, params, self.engine.tokenizer.eos_token_ids, room))
        engine = self.engine
        while any(not search.done for search in searches):
            tops: dict[str, list[tuple[int, float]]] = {}
            steps = []  # per search: its beams' request ids
            try:
                for search in searches:
                    ids = []
                    for tokens in search.pending():
                        ids.append(f"beam-{next(self._ids)}")
                        engine.add_request(ids[-1], tokens, search.step_params)
                        tops[ids[-1]] = []
                    steps.append(ids)
                while engine.has_work:
                    for out in engine.step():
                        if out.request_id in tops and out.logprobs:
                            tops[out.request_id] = out.logprobs[0].top
            except BaseException:
                engine.abort(list(tops))
                raise
            for search, ids in zip(searches, steps):
                if ids:
                    search.advance([tops[i] for i in ids])
        tokenizer = engine.tokenizer
        return [
            BeamSearchOutput(search.result(lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)))
            for search in searches
        ]

    def _encode(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), token_ids_of(prompt["prompt_token_ids"])
            if not isinstance(prompt.get("prompt"), str):
                raise ValueError('a prompt dict needs "prompt" (a string) or "prompt_token_ids" (a list of ints)')
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        return None, token_ids_of(prompt)

    def _encode_with_images(self, prompt: PromptType) -> EncodedPrompt:
        """A prompt as `_encode` reads it, or one with vLLM's multi_modal_data through the model's processor."""
        media = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if media is None:
            return EncodedPrompt(*self._encode(prompt))
        processor = self.engine.processor
        if processor is None:
            raise ValueError("multi_modal_data needs a vision-language model served with images")
        assert isinstance(prompt, dict)
        if not isinstance(media, dict) or set(media) - {"image"}:
            raise ValueError('multi_modal_data takes {"image": <a PIL image or a list of them>}')
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError('a prompt with multi_modal_data needs its "prompt" text (its image placeholders)')
        images = pil_images(media.get("image", []), "multi_modal_data.image")
        return EncodedPrompt(text, *processor.process(text, images, add_special_tokens=True, param="multi_modal_data"))

    def _run(
        self,
        encoded: Sequence[EncodedPrompt],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        priority: Optional[Sequence[int]] = None,
        loras: Optional[Sequence[Optional[LoRAMix]]] = None,
        salts: Optional[Sequence[Optional[str]]] = None,
    ) -> list[GenerationResult]:
        engine = self.engine
        parents: list[tuple[str, list[str]]] = []
        try:
            for index, ((_, token_ids, multi_modal), params) in enumerate(zip(encoded, params_list)):
                parent = f"offline-{next(self._ids)}"
                children = fan_out(parent, params)
                parents.append((parent, [child_id for child_id, _ in children]))
                for child_id, child_params in children:
                    engine.add_request(
                        child_id,
                        token_ids,
                        child_params,
                        priority=0 if priority is None else priority[index],
                        lora=None if loras is None else loras[index],
                        cache_salt=None if salts is None else salts[index],
                        multi_modal=multi_modal,
                    )
        except BaseException:
            engine.abort([c for _, children in parents for c in children])
            raise
        results = {child: OutputAccumulator() for _, children in parents for child in children}
        try:
            with tqdm(total=len(results), desc="generating", unit="seq", disable=not use_tqdm) as bar:
                while engine.has_work:  # the last step tells the runner which requests ended
                    for out in engine.step():
                        accumulator = results.get(out.request_id)
                        if accumulator is None:
                            continue  # (a request of a call cut short before, ended by its abort)
                        accumulator.add(out)
                        if out.finished:
                            bar.update(1)
        except BaseException:  # (Ctrl-C in a notebook): this call's requests end here, not in the next call
            engine.abort([child for child, result in results.items() if result.finish_reason is None])
            raise
        decode = _token_texts(engine.tokenizer)
        return [
            _result(parent, prompt, token_ids, [results[child] for child in children], decode)
            for (parent, children), (prompt, token_ids, _) in zip(parents, encoded)
        ]


def _token_texts(tokenizer: Tokenizer) -> Callable[[int], str]:
    """A token id's text, decoded alone (special tokens shown), as vLLM's Logprob.decoded_token; each id once."""
    texts: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    return decode


def _result(
    parent: str,
    prompt: Optional[str],
    token_ids: list[int],
    children: list[OutputAccumulator],
    decode: Callable[[int], str],
) -> GenerationResult:
    outputs = [
        CompletionOutput(
            index=index,
            text=child.text,
            token_ids=child.token_ids,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=None if child.logprobs is None else [PositionLogprobs(e, decode) for e in child.logprobs],
            error=child.error,
            cumulative_logprob=None if child.logprobs is None else sum(e.logprob for e in child.logprobs),
        )
        for index, child in enumerate(children)
    ]
    return GenerationResult(
        request_id=parent,
        prompt=prompt,
        prompt_token_ids=token_ids,
        prompt_logprobs=prompt_logprobs(children[0].prompt_logprobs, decode),
        outputs=outputs,
        num_cached_tokens=children[0].num_cached_tokens,
    )


def _is_conversation(messages: Union[list[dict], Sequence[list[dict]]]) -> "TypeIs[list[dict]]":
    """One conversation (its messages), not a list of them."""
    return bool(messages) and isinstance(messages[0], dict)


def _as_params_list(
    params: Union[SamplingParams, Sequence[SamplingParams], None], count: int, default: Callable[[], SamplingParams]
) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, (str, dict)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, not {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params must be SamplingParams, not {type(bad).__name__}")
    return params
