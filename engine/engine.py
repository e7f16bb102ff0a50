"""EngineCore: the step loop that ties the scheduler, the model runner and the text together.

add_request / abort
      |
      v
1. scheduler.schedule()              -> SchedulerOutput
2. runner.execute(scheduler_output)  -> ModelRunnerOutput (one forward pass)
3. scheduler.update_from_output(...) -> token-level stops, frees finished requests
4. detokenize, stop strings          -> RequestOutput per request that progressed
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from engine.text.detokenizer import IncrementalDetokenizer
from engine.engine_config import EngineConfig
from engine.runner.fault_isolation import FaultInjector
from engine.runner.model_runner import ModelRunner
from engine.runner.pipeline_runner import LaunchedStep, PipelineRunner
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.last_state_proposer import LastStateProposer
from engine.errors import InvalidParameterError
from engine.kv_tier.disk_tier import KVTierReadError
from engine.lora.lora_manager import LoRAManager
from engine.lora.lora_waiting import (
    load_budget,
    LoRAWaitingRequests,
    adapter_names,
    attach,
)
from engine.lora.request import LoRAMix
from engine.observer import EngineObserver
from engine.multimodal.inputs import MultiModalInputs
from engine.multimodal.processor import MultiModalProcessor
from engine.outputs import ModelRunnerOutput, RequestOutput
from engine.request_state import RequestState
from engine.sampling.bad_words import bad_words_token_ids
from engine.sampling.sampler import TokenLogprobs
from engine.pooling.params import PoolingParams, PoolingType
from engine.pooling.pooler_config import ModelPooler
from engine.sampling.params import SamplingParams
from engine.structured.grammar_compiler import GrammarCompiler
from engine.structured.grammar_ref import GrammarRef
from engine.text.stop_strings import StopStringMatcher
from engine.text.tokenizer import Tokenizer, check_token_ids
from scheduler import (
    DuplicateRequestIdError,
    MinTokensOutOfRangeError,
    Request,
    RequestStatus,
    RequestStepOutput,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

PROFILE_LOG_EVERY = 1000
"""Steps between two logged profiles (`--profile`): cumulative since start."""


class EngineShutDownError(RuntimeError):
    """A request or a step reached an engine after its shutdown()."""


class EngineCore:
    """Synchronous engine: `add_request`, `abort`, then `step()` until no work is left.

    Not thread-safe: one thread drives it (see `AsyncEngine` for the server).
    Build it with `engine.builder.build_engine(config)`.
    """

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        model_name: str,
        grammar_compiler: GrammarCompiler,
        lora_manager: Optional[LoRAManager] = None,
        default_sampling: Optional[Mapping[str, Any]] = None,
        model_source: Optional[str] = None,
        pooler: Optional[ModelPooler] = None,
        processor: Optional[MultiModalProcessor] = None,
    ):
        self.config = config
        # a vision-language model's processor (prompts with images: engine/multimodal/); None for a text model
        self.processor = processor
        self.pooler = pooler  # a pooling model's (embeddings; it generates nothing): None for a generative one
        self.model_source = model_source or model_name  # the checkpoint as given (/v1/models' root)
        # the model's sampling defaults (its generation_config.json: engine/loading/generation_defaults.py),
        # taken by requests that leave those fields unset
        self.default_sampling: dict[str, Any] = dict(default_sampling or {})
        self.lora_manager = lora_manager  # None unless enable_lora
        self._lora_waiting = LoRAWaitingRequests()  # requests whose adapters load in the background
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len: int = scheduler.max_model_len
        model = runner.model
        assert model is not None  # a runner not yet shut down
        self.vocab_size = model.arch.vocab_size
        self.model_dtype: torch.dtype = model.dtype
        self.quantization: str = model.quantization
        self.weight_bytes: int = model.weight_bytes()  # what the weights took, also after shutdown
        self._states: dict[str, RequestState] = {}
        self.num_steps = 0
        self.last_step_num_tokens = 0
        self._last_step_seconds = 0.0
        self.is_shut_down = False
        self.grammar_compiler = grammar_compiler
        self.profile = runner.profile
        # Pipeline parallelism: up to one step per stage in flight, oldest first (engine/runner/pipeline_runner.py).
        self._pipeline = runner if isinstance(runner, PipelineRunner) else None
        self._in_flight: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()

    @property
    def fault_injector(self) -> Optional[FaultInjector]:
        """Tests only: hooks that corrupt logits or fail detokenization (see fault_isolation)."""
        return self.runner.sampler.injector

    @fault_injector.setter
    def fault_injector(self, injector: Optional[FaultInjector]) -> None:
        self.runner.sampler.injector = injector

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` (from another thread) when a part of the engine in another process fails while the
        engine is idle: a tensor-parallel worker's exit (a failure within a step raises from `step` instead)."""
        if self.runner.peers is not None:
            self.runner.peers.on_failure(callback)

    def shutdown(self) -> None:
        """End every request (finish_reason "abort") and release the KV cache, the CUDA graphs and the
        weights; nothing is served after. Idempotent. Dropping the last reference to the engine frees the
        same memory (nothing in it forms a reference cycle); this does it at a known point."""
        if self.is_shut_down:
            return
        try:
            self.abort(list(self._states))
            self._drain_pipeline()
            self.runner.shutdown()
            if self.scheduler.kv_cache_manager.kv_tiers is not None:  # (after the runner has written its blocks)
                self.scheduler.kv_cache_manager.kv_tiers.close()
            if isinstance(self.scheduler.proposer, (DraftModelProposer, EagleProposer, LastStateProposer)):
                self.scheduler.proposer.shutdown()  # the draft's KV cache, the last states kept (weights go with it)
        finally:  # half released is no state to step in
            self.is_shut_down = True

    def _drain_pipeline(self) -> None:
        """Take the outputs of the steps still in flight (the stages finish what they were given), unused."""
        pipeline = self._pipeline
        while pipeline is not None and self._in_flight:
            _, launched = self._in_flight.popleft()
            try:
                pipeline.finish(launched)
            except Exception as error:  # noqa: BLE001 - a stage already gone: the shutdown goes on without it
                logger.warning("a step in flight did not finish at shutdown: %s", error)
                self._in_flight.clear()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise EngineShutDownError("the engine was shut down: build a new one to generate")

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: Union[SamplingParams, PoolingParams],
        *,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        grammar: Optional["xgrammar.CompiledGrammar"] = None,
        lora: Optional[LoRAMix] = None,
        cache_salt: Optional[str] = None,
        multi_modal: Optional[MultiModalInputs] = None,
    ) -> None:
        """Queue one sequence (fan `n > 1` out first, see `parallel_sampling.fan_out`), or with PoolingParams one
        prompt to pool (a pooling model's: its one output carries the embedding).

        `grammar`: the compiled `params.structured_outputs`, compiled beforehand off this thread (AsyncEngine);
        without it the constraint is compiled here, synchronously (the offline `LLM`, which adds its requests
        before it steps). `lora`: the adapters to run with (None: the base model); one still loading makes the
        request wait beside the queue. `cache_salt` (vLLM's): only requests of the same salt share cached blocks.
        `multi_modal`: the prompt's images (a vision-language model's processor made them with the token ids).
        Raises a RequestRejectedError for a request that can never be served (LoRANotFoundError for an unknown
        adapter).
        """
        self._check_running()
        if request_id in self._lora_waiting:  # (not yet in the scheduler, which checks the others)
            raise DuplicateRequestIdError(request_id)
        ref = None
        if lora is not None:
            if self.lora_manager is None:
                raise InvalidParameterError("lora", "needs an engine started with LoRA enabled (--enable-lora)")
            if request_id in self._states:
                raise DuplicateRequestIdError(request_id)
            self.lora_manager.check(lora)
            ref = self.lora_manager.resolve(lora)
        if isinstance(params, PoolingParams):
            if multi_modal is not None:
                raise InvalidParameterError("multi_modal_data", "is not taken by a pooling request")
            request = self.make_pooling_request(
                request_id, prompt_token_ids, params, arrival_time, priority, cache_salt
            )
            state = RequestState(request, params, None, None)
        else:
            state = self._generation_state(
                self.make_request(
                    request_id, prompt_token_ids, params, arrival_time, priority, grammar, cache_salt, multi_modal
                )
            )
            request = state.request
        if lora is not None and ref is None:  # its adapter loads in the background
            self.scheduler.check_request(request)
            self._lora_waiting.add(request, lora)
        else:
            if ref is not None:
                attach(request, ref)
            self.scheduler.add_request(request)  # the last step that can refuse it; the runner
            # learns of the request from the step message that first schedules it
        if lora is not None and self.lora_manager is not None:
            self.lora_manager.count_request(lora)
        self._states[request_id] = state

    def _generation_state(self, request: Request) -> RequestState:
        """The engine's bookkeeping of a request that generates: its detokenizer and stop strings."""
        params = request.sampling_params
        assert isinstance(params, SamplingParams)  # (make_request's)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer.hf,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        state = RequestState(request, params, detokenizer, matcher)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        return state

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        grammar: Optional["xgrammar.CompiledGrammar"] = None,
        cache_salt: Optional[str] = None,
        multi_modal: Optional[MultiModalInputs] = None,
    ) -> Request:
        """The scheduler request for these inputs, validated against the model (not queued); a constrained one
        holds its compiled grammar (`grammar`, or compiled now) until it ends; one with images (`multi_modal`)
        carries them to the runner."""
        if self.pooler is not None:
            raise InvalidParameterError(
                "model", f"{self.model_name!r} is served for pooling (embeddings): it generates no tokens"
            )
        if params.n != 1:
            raise InvalidParameterError(
                "n", "must be 1 for one engine request (fan n > 1 out with engine.sampling.parallel.fan_out)"
            )
        prompt = list(prompt_token_ids)
        check_token_ids(prompt, self.vocab_size, "prompt")
        params.verify_vocab(self.vocab_size)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", "must be a non-empty string")
        if multi_modal is not None:
            self._check_images(prompt, multi_modal)
        if params.bad_words_token_ids is not None:  # (vLLM's _bad_words_token_ids: never the caller's)
            raise InvalidParameterError("bad_words_token_ids", "is set by the engine from bad_words; give bad_words")
        if params.bad_words:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            params = params.replace(bad_words_token_ids=bad_words_token_ids(encode, params.bad_words, self.vocab_size))
        grammar_ref = None
        if params.structured_outputs is not None:
            if grammar is None:
                grammar = self.grammar_compiler.compile(params.structured_outputs)
            grammar_ref = GrammarRef(grammar)
        max_tokens = params.max_tokens
        if max_tokens is None:  # the rest of the context, as far as the whole KV cache holds it
            limit = self.max_sequence_len
            max_tokens = max(limit - len(prompt), 1)
            # only here is the bound min_tokens must respect known; a prompt that leaves no room at all is the
            # scheduler's context-length refusal instead (add_request)
            if len(prompt) < limit and params.min_tokens > max_tokens:
                raise MinTokensOutOfRangeError(params.min_tokens, max_tokens)
        kwargs: dict[str, Any] = {} if arrival_time is None else {"arrival_time": arrival_time}
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),  # (clamped only where the prompt leaves no room)
            eos_token_ids=self.tokenizer.eos_token_ids,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            priority=priority,
            cache_salt=cache_salt,
            skip_prefix_cache=params.prompt_logprobs is not None,
            sampling_params=params,
            grammar=grammar_ref,
            multi_modal=multi_modal,
            media_spans=() if multi_modal is None else multi_modal.spans,
            bidirectional_media=multi_modal is not None and multi_modal.bidirectional,
            num_speculative_tokens=self._num_speculative_tokens(params),
            **kwargs,
        )

    def _check_images(self, prompt: list[int], multi_modal: MultiModalInputs) -> None:
        """The images' placeholders lie in the prompt, in order, on the model's image token, with rotary positions
        where the model's RoPE is multimodal (and only there)."""
        processor = self.processor
        if processor is None:
            raise InvalidParameterError(
                "multi_modal_data", f"holds images; {self.model_name!r} is served without images"
            )
        processor.check_count(len(multi_modal.images), "multi_modal_data")
        if not multi_modal.images:
            raise InvalidParameterError("multi_modal_data", "holds no image (give None for a prompt without images)")
        token, previous_end = processor.image_token_id, 0
        for image in multi_modal.images:
            if not image.positions or image.start < previous_end or image.end > len(prompt):
                raise InvalidParameterError("multi_modal_data", "places an image outside its prompt, or out of order")
            if any(prompt[p] != token for p in image.positions):
                raise InvalidParameterError(
                    "multi_modal_data", f"places an image where the prompt holds no image token (id {token})"
                )
            rope = image.rope_positions
            if (processor.rope is None) != (rope is None) or (rope is not None and rope.shape != (image.num_embeds, 3)):
                raise InvalidParameterError(
                    "multi_modal_data", "holds images whose multimodal RoPE positions do not fit the model's processor"
                )
            previous_end = image.end

    def make_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: PoolingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
    ) -> Request:
        """The scheduler request pooling this prompt (computed, nothing sampled), validated against the model."""
        if self.pooler is None:
            raise InvalidParameterError(
                "pooling", f"needs a pooling model; {self.model_name!r} is served for generation (--runner generate)"
            )
        pooling = self.pooler.resolve(params, self.model_name)
        prompt = list(prompt_token_ids)
        check_token_ids(prompt, self.vocab_size, "prompt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", "must be a non-empty string")
        kwargs: dict[str, Any] = {} if arrival_time is None else {"arrival_time": arrival_time}
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=0,
            prefill_only=True,
            priority=priority,
            cache_salt=cache_salt,
            # a cached block's positions would not be pooled: only the last token's pooling takes cache hits
            skip_prefix_cache=pooling.type is not PoolingType.LAST,
            sampling_params=pooling,
            num_speculative_tokens=0,
            **kwargs,
        )

    @property
    def max_sequence_len(self) -> int:
        """Prompt plus output tokens one sequence can reach: max_model_len, or fewer where the whole KV cache holds
        fewer (the last sampled token needs no slot: it is never fed back)."""
        scheduler = self.scheduler
        held = scheduler.kv_cache_manager.max_tokens_held(scheduler.scheduler_config.max_num_batched_tokens)
        return min(self.max_model_len, held + 1)

    @staticmethod
    def _num_speculative_tokens(params: SamplingParams) -> Optional[int]:
        """The request's own cap on draft tokens: 0 when it opts out, None for the engine's."""
        return 0 if not params.speculative else params.num_speculative_tokens

    def abort(self, request_ids: Iterable[str], reason: str = "aborted") -> list[RequestOutput]:
        """End requests in any state; returns their final outputs (finish_reason "abort", `reason` as their
        abort_reason)."""
        outputs = []
        now = time.monotonic()
        request_ids = list(request_ids)
        for request_id in request_ids:
            if self._lora_waiting.remove(request_id) is not None:  # never reached the scheduler
                outputs.append(self._output(self._states.pop(request_id), [], "", "abort", now, abort_reason=reason))
        for request in self.scheduler.abort(request_ids):  # the next step message tells the runner
            state = self._states.pop(request.request_id)
            outputs.append(self._output(state, [], "", "abort", now, abort_reason=reason))
        for request_id in request_ids:  # ended in the scheduler by a step whose outputs were never taken (a
            self._states.pop(request_id, None)  # call cut short inside `_complete`): nothing left to say
        if outputs and self.lora_manager is not None:  # (no step may follow: the gauge must not keep them)
            self._record_lora_activity(self.lora_manager)
        return outputs

    def observe(self, observer: EngineObserver) -> None:
        """Report grammar compile and fill times to `observer` (AsyncEngine.observe registers it)."""
        self.grammar_compiler.on_compile = observer.on_grammar_compile
        if self.runner.grammar is not None:
            self.runner.grammar.on_fill = observer.on_grammar_fill

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self._lora_waiting)

    @property
    def has_work(self) -> bool:
        """Requests to step, ended ones the runner has not been told of (a step tells it), or steps in flight."""
        return (
            self.scheduler.has_unfinished_requests
            or self.scheduler.has_finished_notices
            or bool(self._in_flight)
            or bool(self._lora_waiting)
            or (self.lora_manager is not None and self.lora_manager.is_loading)
        )

    @property
    def steps_in_flight(self) -> int:
        """Steps launched and not yet finished (pipeline parallelism; 0 between steps otherwise)."""
        return len(self._in_flight)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests + len(self._lora_waiting)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        self._check_running()
        profile = self.profile
        if profile is not None:
            profile.begin_step()
        if self.lora_manager is None:
            return self._step()
        outputs = self._admit_loaded_loras()
        started = time.monotonic()
        outputs += self._step()
        self._last_step_seconds = time.monotonic() - started  # what a load may take a share of next time
        self._record_lora_activity(self.lora_manager)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self._pipeline is not None:
            return self._pipelined_step(self._pipeline)
        scheduler_output = self._schedule()
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        try:
            runner_output = self.runner.execute(scheduler_output)
        except KVTierReadError as error:
            if self.runner.peers is not None:
                raise  # (the other ranks went on to the forward: the ranks are out of step)
            return self._lost_restores(scheduler_output, error)
        if scheduler_output.is_empty:
            return []
        return self._complete(scheduler_output, runner_output)

    def _lost_restores(self, scheduler_output: SchedulerOutput, error: KVTierReadError) -> list[RequestOutput]:
        """Disk blocks the scheduler had found good did not read back (a file deleted or altered in between): the
        step is dropped before its forward ran (the runner took the message's other changes), the tier forgets
        those blocks, and the requests that were to restore them go back to the queue to compute them, as if
        preempted; the step's other requests are scheduled again as if it had never been."""
        logger.warning("%s: the requests restoring it compute it instead", error)
        tiers = self.scheduler.kv_cache_manager.kv_tiers
        bad = set(error.block_hashes)
        if tiers is not None and tiers.disk is not None:
            tiers.disk.forget(bad)
        lost = {block_id for block_hash, block_id in scheduler_output.kv_tier_restores if block_hash in bad}
        affected = [
            new.request_id
            for new in scheduler_output.new_requests
            if any(block_id in lost for group in new.block_ids for block_id in group)
        ]
        self.scheduler.abandon_steps()
        self.scheduler.recompute(affected)
        return []

    def _admit_loaded_loras(self) -> list[RequestOutput]:
        """Advance the adapter loads in progress, then queue the requests whose adapters finished loading
        (failing those whose load failed)."""
        manager = self.lora_manager
        assert manager is not None
        failed: list[RequestOutput] = []
        busy = self.scheduler.has_unfinished_requests
        manager.advance_loads(load_budget(busy, self._last_step_seconds))  # (also ends the last's news)
        if self._lora_waiting:

            def fail(request_id: str, error: BaseException) -> None:
                state = self._states.pop(request_id)
                message = f"loading its LoRA adapter failed: {type(error).__name__}: {error}"
                failed.append(self._output(state, [], "", "error", time.monotonic(), error=message))

            self._lora_waiting.admit_ready(manager, self.scheduler.add_request, fail)
        return failed

    def _record_lora_activity(self, manager: LoRAManager) -> None:
        """Tell the manager the adapters of running and waiting requests (its gauge; idle ones are evictable)."""
        scheduler = self.scheduler
        manager.record_activity(
            sorted({n for r in scheduler.running for n in adapter_names(r)}),
            sorted({n for r in scheduler.waiting for n in adapter_names(r)} | set(self._lora_waiting.names())),
        )

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if self.profile is not None:
            self.profile.lap("schedule")
        scheduled_at = time.monotonic()
        for new in scheduler_output.new_requests:
            state = self._states[new.request_id]
            if state.first_scheduled_time is None:
                state.first_scheduled_time = scheduled_at
        return scheduler_output

    def _pipelined_step(self, pipeline: PipelineRunner) -> list[RequestOutput]:
        """Launch steps until every stage has one (or nothing more can be scheduled: a request waits for its
        step's tokens before its next), then finish the oldest: its outputs."""
        in_flight = self._in_flight
        while len(in_flight) < self.scheduler.scheduler_config.max_concurrent_batches:
            scheduler_output = self._schedule()
            if scheduler_output.is_empty:
                if scheduler_output.finished_request_ids or scheduler_output.preempted_request_ids:
                    pipeline.launch(scheduler_output)  # the ranks forget those requests too
                break
            in_flight.append((scheduler_output, pipeline.launch(scheduler_output)))
        if not in_flight:
            return []
        scheduler_output, launched = in_flight.popleft()
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        return self._complete(scheduler_output, pipeline.finish(launched))

    def _complete(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """The scheduler and the requests' texts advanced by a step's output."""
        profile = self.profile
        failures = self.runner.sampler.take_failures()
        step_outputs = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids, runner_output.draft_features
        )
        if profile is not None:
            profile.lap("update")
        now = time.monotonic()
        self.num_steps += 1
        for request_id, chunk in runner_output.prompt_logprobs.items():
            # The chunk scores prompt tokens start + 1 onwards; a recompute after a preemption
            # repeats positions already held, which are kept as first scored.
            state = self._states.get(request_id)
            if state is None:
                continue  # aborted while its step was in flight (pipeline parallelism)
            held = state.prompt_logprobs
            assert held is not None, "prompt logprobs for a request that did not ask for them"
            num_repeated = len(held) - scheduler_output.num_computed_tokens[request_id] - 1
            assert num_repeated >= 0, "prompt logprobs arrived out of order"
            held.extend(chunk[num_repeated:])
        outputs = []
        pooled = runner_output.pooled
        for step_output in step_outputs:
            request_id = step_output.request_id
            failure = failures.get(request_id)
            if request_id in pooled:
                outputs.append(self._pooled(request_id, pooled[request_id], now))
                continue
            if failure is None:
                try:
                    outputs.append(self._process(step_output, runner_output.logprobs.get(request_id), now))
                    continue
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failure = f"processing its output failed: {type(exc).__name__}: {exc}"
            outputs.append(self._fail(request_id, failure, now))
        if profile is not None:
            profile.lap("detokenize")
            profile.end_step()
            if self.num_steps % PROFILE_LOG_EVERY == 0:
                logger.info("%s", profile.table())
        return outputs

    def _pooled(self, request_id: str, embedding: torch.Tensor, now: float) -> RequestOutput:
        """A pooling request's one output: its prompt computed, its embedding (finish_reason "stop")."""
        state = self._states.pop(request_id)
        state.first_token_time = state.last_token_time = now
        return self._output(state, [], "", "stop", now, embedding=embedding.tolist())

    def _fail(self, request_id: str, message: str, now: float) -> RequestOutput:
        """End one request with finish_reason "error"; the others go on."""
        logger.error("request %s failed: %s", request_id, message)
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)  # frees its blocks (if unfinished)
        state = self._states.pop(request_id)
        return self._output(state, [], "", "error", now, error=message)

    def _process(
        self, step_output: RequestStepOutput, logprobs: Optional[list[TokenLogprobs]], now: float
    ) -> RequestOutput:
        """Text, stop strings and timestamps for one request's new tokens."""
        request_id = step_output.request_id
        state = self._states[request_id]
        if self.runner.sampler.injector is not None:
            self.runner.sampler.injector.on_detokenize(request_id)
        finish_reason = step_output.status.finish_reason
        stop_reason = step_output.stop_reason
        new_token_ids = step_output.new_token_ids
        delta, stop, num_kept = self._text_of(state, step_output, finishing=finish_reason is not None)
        if stop is not None:
            if num_kept < len(new_token_ids):  # a stop string inside an accepted run of drafts: what follows
                new_token_ids = new_token_ids[:num_kept]  # it was never generated, as without drafts
                request = state.request
                del request.output_token_ids[request.num_output_tokens - len(step_output.new_token_ids) + num_kept :]
                del request.all_token_ids[request.num_prompt_tokens + request.num_output_tokens :]
            if finish_reason is None or num_kept < len(step_output.new_token_ids):
                self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED, stop)
            finish_reason, stop_reason = "stop", stop
        if state.first_token_time is None:
            state.first_token_time = now
        state.previous_token_time, state.last_token_time = state.last_token_time, now
        if finish_reason is not None:
            del self._states[request_id]
        return self._output(
            state,
            new_token_ids,
            delta,
            finish_reason,
            now,
            stop_reason,
            None if logprobs is None else logprobs[: len(new_token_ids)],
        )

    def _text_of(
        self, state: RequestState, step_output: RequestStepOutput, finishing: bool
    ) -> tuple[str, Optional[str], int]:
        """The new tokens' text through the stop strings: (text to emit, stop string hit, how many of the new
        tokens stay). An accepted run of drafts goes token by token, as decoding without drafts sees it: a stop
        string counts only from min_tokens output tokens on, and ends the output at the token completing it."""
        text_ids = self._text_token_ids(state, step_output)
        num_new = len(step_output.new_token_ids)
        before = state.request.num_output_tokens - num_new  # output tokens before this step's
        min_tokens = state.sampling.min_tokens
        if state.stop_matcher is None or len(text_ids) <= 1:
            text = state.text_decoder.add_tokens(text_ids)
            delta, stop = state.take_text(text, finishing=finishing, check_stops=before + num_new >= min_tokens)
            return delta, stop, num_new
        pieces = []
        for index, token_id in enumerate(text_ids):
            last = index == len(text_ids) - 1
            piece, stop = state.take_text(
                state.text_decoder.add_tokens([token_id]),
                finishing=finishing and last,
                check_stops=before + index + 1 >= min_tokens,
            )
            pieces.append(piece)
            if stop is not None:
                return "".join(pieces), stop, index + 1
        return "".join(pieces), None, num_new

    @staticmethod
    def _text_token_ids(state: RequestState, step_output: RequestStepOutput) -> Sequence[int]:
        """The tokens whose text the output shows: a stop token's (eos or stop_token_ids) is left
        out unless include_stop_str_in_output, as vLLM does."""
        token_ids = step_output.new_token_ids
        if (
            step_output.status is RequestStatus.FINISHED_STOPPED
            and token_ids
            and not state.sampling.include_stop_str_in_output
        ):
            return token_ids[:-1]
        return token_ids

    def _output(
        self,
        state: RequestState,
        new_token_ids: list[int],
        delta: str,
        finish_reason: Optional[str],
        now: float,
        stop_reason=None,
        logprobs=None,
        error: Optional[str] = None,
        abort_reason: Optional[str] = None,
        embedding: Optional[list[float]] = None,
    ) -> RequestOutput:
        request = state.request
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            text_delta=delta,
            text=state.text,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            metrics=state.metrics(None if finish_reason is None else now),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            error=error,
            abort_reason=abort_reason,
            embedding=embedding,
        )
