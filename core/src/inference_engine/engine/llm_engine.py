"""The synchronous engine: requests in, one scheduled forward per ``step()``, outputs out."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_engine.config import EngineConfig
from inference_engine.distributed.launch import start_executor
from inference_engine.distributed.worker import engine_device_ids
from inference_engine.engine.held_samples import HeldSamples
from inference_engine.engine.kv_cache import BlockManager, KVCachePool, log_capacity
from inference_engine.engine.loader import load_model
from inference_engine.engine.model_runner import ModelRunner, StepBatch
from inference_engine.engine.output_state import OutputsWithPending, RequestGroup, SequenceState
from inference_engine.engine.prompt_fork import PromptForks
from inference_engine.engine.request import FinishReason, Request, RequestStatus
from inference_engine.engine.multi_step import MultiStepPlanner
from inference_engine.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from inference_engine.engine.state_cache import (
    StateCachePool,
    StateSlotManager,
    state_capacity_message,
    state_layers,
)
from inference_engine.interfaces.block_diffusion import BlockDiffusionLM
from inference_engine.interfaces.platform import MemoryProfiler
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import CompletionOutput, RequestOutput
from inference_engine.platforms.selection import select_platform, set_current_platform
from inference_engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLMEngine", "PromptInput"]

logger = logging.getLogger(__name__)

PromptInput = str | dict[str, Any] | list[int]

# Default KV pool where device memory is not profiled (the host): this share of free
# memory, capped.
DEFAULT_KV_FRACTION = 0.25
DEFAULT_KV_CAP = 4 << 30
# Kept out of the KV pool for the decode graphs' private memory pool.
GRAPH_MEMORY_RESERVE = 512 << 20


@dataclass
class _StepInFlight:
    """A launched step whose sampled ids are not read back yet."""

    # The sequences that sample, in row order.
    sampling: list[SequenceState]
    # [rows] int64 sampled ids on the device (the next step feeds pending tokens from it),
    # and their host copy (filled asynchronously; valid after ``event``).
    sampled: torch.Tensor | None
    host: torch.Tensor | None
    event: Any
    logprobs: list[Any] | None
    # request id -> row of ``sampled``.
    source_rows: dict[str, int] = field(default_factory=dict)


class LLMEngine:
    """Owns the model, KV cache, scheduler and sampler; not thread-safe."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        self.platform = select_platform(config.parallel.platform, engine_device_ids(config))
        set_current_platform(self.platform)
        self.platform.set_up_process()
        built = self.platform.build_kernels()
        if built > 1.0:  # a first start on this machine: compilers ran
            logger.info("platform kernels built in %.1f s (cached for later starts)", built)
        # Tensor/expert parallelism: the other ranks started (or joined) before the model is
        # built, as its layers take their shard from the process's groups (distributed/).
        self.executor = start_executor(config)
        if self.executor is not None:
            weakref.finalize(self, self.executor.shutdown)
        if config.model.seed is not None:
            torch.manual_seed(config.model.seed)
        loaded = load_model(config.model, config.quant, self.platform, show_progress)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = loaded.max_model_len
        self.dtype = loaded.dtype
        sched = config.scheduler
        max_num_seqs_given = sched.max_num_seqs is not None
        if sched.max_num_seqs is None:
            sched.max_num_seqs = self.platform.default_max_num_seqs()
        block_size = config.cache.block_size
        # LoRA slots wrap the linear layers before the runner binds the cache (which decides
        # whether the C++ decode step can run the layers: not with LoRA).
        self.lora = self._make_lora_manager()
        self.runner = ModelRunner(
            self.model,
            self.platform,
            block_size,
            self.max_model_len,
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            num_speculative_tokens=(config.speculative.num_speculative_tokens
                                    if config.speculative.enabled else 0),
            # A step's adapter groups change from step to step: no captured graphs.
            # Block diffusion: the encoder's MoE reads routing counts on the host, and its
            # denoise passes run eagerly in any case.
            enforce_eager=config.model.enforce_eager or self.lora is not None
            or self.executor is not None  # no graphs around collectives (yet)
            or isinstance(self.model, BlockDiffusionLM),
        )
        if self.executor is not None:  # the runner's collective calls reach every rank
            self.runner = self.executor.wrap_runner(self.runner)
        # Hybrid and encoder-decoder models: a per-sequence state slot for every request that
        # can run at once, allocated before the KV pool is sized (it comes out of the same
        # budget; _num_state_slots).
        state_pool = self.runner.allocate_state_cache(self._num_state_slots(max_num_seqs_given))
        self._state_cache_bytes = state_pool.num_bytes if state_pool is not None else 0
        if state_pool is not None:
            self._refuse_with_state()
        # Speculative decoding (None: off); a drafter's cache shares the pool's geometry.
        self.spec = self._make_spec_decoder()
        if self.spec is not None and self.spec.proposer.reads_target_hidden_states:
            # A graph replay runs no Python: the hooks recording the hidden states would
            # not fire on one-token steps.
            self.runner.enforce_eager = True
        drafter_specs = self.spec.proposer.kv_cache_specs() if self.spec is not None else []
        bytes_per_block = KVCachePool.bytes_per_block_for(
            self.runner.kv_cache_specs() + drafter_specs, block_size)
        num_blocks = self._num_blocks(bytes_per_block)
        pool = self.runner.allocate_kv_cache(num_blocks)
        if self.spec is not None:
            self.spec.proposer.bind_kv_cache(num_blocks)
        self.capacity_message = log_capacity(num_blocks, block_size, pool.bytes_per_block,
                                             [spec.dtype for spec in pool.specs],
                                             self.max_model_len, pool.fault_in_seconds)
        if state_pool is not None:
            self.capacity_message += "; " + state_capacity_message(state_pool)
        self.graphs_message = self.runner.capture_decode_graphs()
        # Prefix caching is off for models with per-sequence state: a cached block's K/V
        # would not bring back the recurrent state after it (no per-block snapshots).
        self.blocks = BlockManager(num_blocks, block_size,
                                   config.cache.enable_prefix_caching and state_pool is None)
        self.state_slots = (StateSlotManager(state_pool.num_slots)
                            if state_pool is not None else None)
        self.blocks.state_slots = self.state_slots
        self.scheduler = Scheduler(sched, self.blocks, self.max_model_len)
        # Block-diffusion models: the DENOISE phase of their requests; None otherwise.
        self.diffusion = self._make_diffusion_stepper()
        if self.lora is not None:
            self.scheduler.max_loras = config.lora.max_loras
        if self.spec is not None:
            self.scheduler.num_lookahead_slots = self.spec.proposer.num_lookahead_slots
        from inference_engine.sampling.sampler import Sampler

        self.sampler = Sampler(seed=config.model.seed, tokenizer=self.tokenizer)
        if self.spec is not None:
            self.spec.attach_sampler(self.sampler)
        from inference_engine.structured_output import StructuredOutputManager

        # Grammar matchers of structured-output sequences (xgrammar loads on first use).
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model.ctx.hf_config.vocab_size, self.eos_token_ids)
        self._groups: dict[str, RequestGroup] = {}
        # Samples of n > 1 requests beyond what the pool holds at their longest.
        self.held = HeldSamples(num_blocks, block_size)
        # n > 1 samples waiting to fork from their group's first sample at its prompt's end
        # (prompt_fork.py): where the prefix cache does not share the prompt (it is off, as
        # for every model with per-sequence state). Not with speculative decoding (drafter
        # caches), a distributed engine (the runner's copies reach one rank) or diffusion.
        self.forks = PromptForks()
        self.fork_prompts = (not self.blocks.enable_prefix_caching and self.spec is None
                             and self.executor is None and self.diffusion is None)
        self.num_forked_samples = 0
        # Child request id -> its output state.
        self._sequences: dict[str, SequenceState] = {}
        self._ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        # Async scheduling (vLLM's): step N+1 is launched before step N's ids are read.
        option = config.scheduler.async_scheduling
        self.async_scheduling = (self.platform.supports_async_scheduling() if option is None
                                 else option) and self.executor is None
        if self.spec is not None:
            if option:
                raise ValueError("async_scheduling and speculative_config cannot be combined: "
                                 "a verify step needs the accepted tokens before the next one")
            self.async_scheduling = False
        self._in_flight: _StepInFlight | None = None
        # Windows of several greedy decode steps for a lone greedy stream (multi_step.py).
        self.multi_step = self._make_multi_step()
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0

    def shutdown(self) -> None:
        """Stop the other ranks of a distributed engine (nothing to do on one device)."""
        if self.executor is not None:
            self.executor.shutdown()

    # ---- set-up -------------------------------------------------------------
    def _make_lora_manager(self) -> Any:
        if not self.config.lora.enable_lora:
            return None
        from inference_engine.lora.manager import LoRAManager

        return LoRAManager(self.model, self.config.lora, self.platform.device(), self.dtype)

    def _make_diffusion_stepper(self) -> Any:
        """The denoise runner of a block-diffusion model, with the checkpoint's settings.

        Raises:
            ValueError: a canvas longer than the step's token budget (it could never run),
                or a bad diffusion value in the generation config.
        """
        if not isinstance(self.model, BlockDiffusionLM):
            return None
        from inference_engine.diffusion import DiffusionSettings
        from inference_engine.engine.diffusion_step import DiffusionStepper

        budget = self.config.scheduler.max_num_batched_tokens
        if self.model.canvas_length > budget:
            raise ValueError(f"the model denoises canvases of {self.model.canvas_length} tokens; "
                             f"max_num_batched_tokens ({budget}) must be at least that")
        defaults = DiffusionSettings.from_generation_config(self.loaded.generation_config)
        return DiffusionStepper(self.model, self.platform.device(), self.config.cache.block_size,
                                defaults)

    def _refuse_with_state(self) -> None:
        """Refuse what a model with per-sequence state layers cannot run yet.

        Raises:
            ValueError: speculative decoding (rejected drafts would have advanced the
                recurrent state: there is no rewind) or a distributed engine (the state pool
                lives on one rank).
        """
        kinds = sorted({type(layer).__name__ for layer in self.runner.state_layers})
        what = f"{type(self.model).__name__} keeps per-sequence state ({', '.join(kinds)})"
        if self.config.speculative.enabled:
            raise ValueError(f"speculative decoding is not supported: {what}, which rejected "
                             f"draft tokens would corrupt (no state rewind)")
        if self.executor is not None:
            raise ValueError(f"tensor/expert/data parallelism is not supported: {what}, "
                             f"allocated on one rank only")

    def _make_spec_decoder(self) -> Any:
        """The speculative decoder of ``speculative_config``; None when it is off."""
        spec = self.config.speculative
        if not spec.enabled:
            return None
        from inference_engine.interfaces.proposer import ProposerContext
        from inference_engine.speculative.decoder import SpecDecoder, build_proposer

        context = ProposerContext(self.config, self.platform, self.model, self.dtype,
                                  self.model.ctx.hf_config.vocab_size, self.max_model_len,
                                  self.config.cache.block_size)
        return SpecDecoder(build_proposer(spec, context))

    def _default_kv_memory(self) -> int:
        """The cache budget without ``--kv-cache-memory`` where no profiler sizes it."""
        free, _total = self.platform.memory_info()
        return min(int(free * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP) if free else 1 << 30

    def _num_state_slots(self, max_num_seqs_given: bool) -> int:
        """Slots of the per-sequence state pool: ``max_num_seqs`` (every request that can
        run at once). Where max_num_seqs is the platform's default and that many slots
        would take more than half the cache budget (Whisper's cross-attention K/V are
        megabytes per request), only as many as half the budget holds: the paged KV keeps
        the rest and admission waits for a free slot. A given ``--max-num-seqs`` is kept
        (and refused by _num_blocks, naming the pool, if it leaves no room)."""
        max_seqs = self.config.scheduler.max_num_seqs
        specs = [layer.state_cache_spec() for layer in state_layers(self.model)]
        if max_num_seqs_given or not specs:
            return max_seqs
        memory = self.config.cache.kv_cache_memory
        profiler = self.platform.memory_profiler()
        if memory is None and profiler is not None:  # before profiling: what is left now
            _free, total = self.platform.memory_info()
            memory = int(total * self.config.cache.gpu_memory_utilization) - profiler.allocated()
        elif memory is None:
            memory = self._default_kv_memory()
        fit = max(1, memory // 2 // StateCachePool.bytes_per_slot_for(specs))
        if fit >= max_seqs:
            return max_seqs
        logger.info("state cache: %d sequence slots (half the cache budget) instead of "
                    "max_num_seqs=%d; pass --max-num-seqs to choose", fit, max_seqs)
        return int(fit)

    def _num_blocks(self, bytes_per_block: int) -> int:
        memory = self.config.cache.kv_cache_memory
        profiler = self.platform.memory_profiler()
        # The per-sequence state pool (hybrid, encoder-decoder models) comes out of the same
        # budget; a profiled budget has it already (allocated: counted with the weights).
        state_bytes = self._state_cache_bytes
        if memory is None and profiler is not None:
            memory = self._profiled_kv_memory(profiler)
            state_bytes = 0
        elif memory is None:
            memory = self._default_kv_memory()
        num_blocks = max(0, memory - state_bytes) // bytes_per_block
        if self.config.cache.kv_cache_memory is None and profiler is None:
            # No point zero-filling more than every sequence at full length could use.
            per_seq = -(-self.max_model_len // self.config.cache.block_size)
            num_blocks = min(num_blocks, self.config.scheduler.max_num_seqs * per_seq + 1)
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory={memory} bytes holds {num_blocks} blocks of {bytes_per_block} "
                f"bytes; at least 2 are needed"
                + (f" (the per-sequence state pool of {self.runner.state_pool.num_slots} "
                   f"slots took {self._state_cache_bytes} bytes of it first: raise "
                   f"--kv-cache-memory or lower --max-num-seqs)"
                   if self._state_cache_bytes else "")
            )
        return int(num_blocks)

    def _profiled_kv_memory(self, profiler: MemoryProfiler) -> int:
        """vLLM's sizing: run a forward at the step's token budget, then give the KV pool
        what ``gpu_memory_utilization`` of the device leaves after weights, that peak,
        memory outside torch's allocator and a reserve for decode graphs.

        Raises:
            ValueError: nothing is left for the pool (names the figures).
        """
        cache = self.config.cache
        profiler.empty_cache()
        profiler.reset_peak()
        weights = profiler.allocated()
        self.runner.profile_run(self.config.scheduler.max_num_batched_tokens)
        peak = profiler.peak_allocated() - weights
        profiler.empty_cache()
        free, total = self.platform.memory_info()
        non_torch = max(0, (total - free) - profiler.reserved())
        graphs = GRAPH_MEMORY_RESERVE if self.runner.graphs_possible()[0] else 0
        budget = int(total * cache.gpu_memory_utilization)
        memory = budget - weights - peak - non_torch - graphs
        summary = (f"{total / 2**30:.1f} GiB x {cache.gpu_memory_utilization} = "
                   f"{budget / 2**30:.2f} GiB: weights {weights / 2**30:.2f} GiB, activation "
                   f"peak {peak / 2**30:.2f} GiB, outside torch {non_torch / 2**30:.2f} GiB, "
                   f"graphs {graphs / 2**30:.2f} GiB")
        if memory <= 0:
            raise ValueError(f"no memory is left for the KV cache ({summary}); raise "
                             f"--gpu-memory-utilization or lower --max-num-batched-tokens")
        logger.info("memory: %s; KV cache %.2f GiB", summary, memory / 2**30)
        return memory

    # ---- requests -----------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, [int(t) for t in prompt]
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; returns its id. ``final_only``: :meth:`step` reports it once, finished
        (as vLLM's ``RequestOutputKind.FINAL_ONLY``), and its text is decoded then.

        Raises:
            ValueError: empty prompt, a prompt at or over the context limit, token
                ids outside the vocabulary, a duplicate id, or a LoRA adapter that cannot
                run (LoRA off, or the adapter's problem named).
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the model's context limit is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        vocab = self.model.ctx.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        params.update_from_tokenizer(self.tokenizer, vocab)
        if self.diffusion is not None:
            self._check_diffusion_request(params, token_ids)
        elif params.extra_args:
            from inference_engine.diffusion.settings import DIFFUSION_KEYS

            misplaced = sorted(set(params.extra_args) & set(DIFFUSION_KEYS))
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: block-diffusion settings; "
                                 f"{type(self.model).__name__} is autoregressive")
        encoder_inputs = self._encoder_inputs(prompt)
        adapter = self._lora_adapter(lora_request)
        stop_ids = frozenset(params.stop_token_ids or ())
        eos = stop_ids if params.ignore_eos else self.eos_token_ids | stop_ids
        kind = params.output_kind
        group = RequestGroup(request_id, text, token_ids,
                             final_only=final_only or kind == RequestOutputKind.FINAL_ONLY,
                             delta=kind == RequestOutputKind.DELTA and not final_only)
        for index in range(params.n):
            child_params = params if params.n == 1 else params.for_sample(index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child = Request(
                request_id=child_id,
                prompt_token_ids=token_ids,
                params=child_params,
                eos_token_ids=eos,
                max_model_len=self.max_model_len,
                lora=adapter,
                encoder_inputs=encoder_inputs,
            )
            if self.diffusion is not None:
                child.diffusion = self.diffusion.new_state(child_params)
            group.children.append(SequenceState(
                child, group, index, self._detokenizer(token_ids, child_params)))
        self._groups[request_id] = group
        for state in group.children:
            self._sequences[state.request.request_id] = state
        admitted = self.held.admit(group)
        if (len(admitted) > 1 and self.fork_prompts and encoder_inputs is None
                and params.structured_outputs is None):
            # The first sample computes the prompt; the others take its caches then.
            self.forks.wait(admitted[0], admitted[1:])
            admitted = admitted[:1]
        for state in admitted:
            self._submit(state.request)
        return request_id

    def _encoder_inputs(self, prompt: PromptInput) -> Any:
        """A prompt dict's ``encoder_inputs`` (Whisper's log-mel features), checked by an
        encoder-decoder model; None for a decoder-only model.

        Raises:
            ValueError: encoder inputs for a decoder-only model, or none (or unusable ones)
                for an encoder-decoder model.
        """
        given = prompt.get("encoder_inputs") if isinstance(prompt, dict) else None
        from inference_engine.interfaces.encoder_decoder import EncoderDecoderLM

        model = self.model if isinstance(self.model, EncoderDecoderLM) else None
        if model is None:
            if given is not None:
                raise ValueError(f"{type(self.model).__name__} is not an encoder-decoder model; "
                                 f"it takes no encoder_inputs")
            return None
        error = model.encoder_input_error(given)
        if error is not None:
            raise ValueError(error)
        return given

    def _check_diffusion_request(self, params: SamplingParams, token_ids: list[int]) -> None:
        """Refuse, by name, what a block-diffusion request cannot do, and check its diffusion
        settings (``extra_args``).

        Raises:
            ValueError: token-by-token sampling controls (temperature and top-k/p/min-p,
                logprobs, penalties, grammars...), image tokens, or an unknown or bad
                diffusion setting.
        """
        unsupported = [name for name, used in (
            # The block's temperature follows the t_max -> t_min schedule; no top-k/p filter.
            ("temperature", params.temperature != 1.0),
            ("top_p", params.top_p != 1.0),
            ("top_k", params.top_k not in (0, -1)),
            ("min_p", params.min_p != 0.0),
            ("logprobs", params.logprobs is not None),
            ("prompt_logprobs", params.prompt_logprobs is not None),
            ("structured_outputs", params.structured_outputs is not None),
            ("repetition_penalty", params.repetition_penalty != 1.0),
            ("presence_penalty", params.presence_penalty != 0.0),
            ("frequency_penalty", params.frequency_penalty != 0.0),
            ("logit_bias", bool(params.logit_bias)),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("bad_words", bool(params.bad_words)),
        ) if used]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported by the block-diffusion "
                             f"model {type(self.model).__name__} (blocks are denoised, not "
                             f"sampled token by token); leave it out")
        image_token = getattr(self.model, "image_token_id", None)
        if image_token is not None and image_token in token_ids:
            raise ValueError(f"image inputs are not supported by {type(self.model).__name__} "
                             f"(text only): the prompt holds the image token {image_token}")
        self.diffusion.defaults.with_overrides(params.extra_args)

    def _submit(self, request: Request) -> None:
        if request.params.structured_outputs is not None:
            # Scheduled once its grammar is compiled (off this thread): see step().
            self.structured.add(request.request_id, request.params.structured_outputs, request)
        else:
            self.scheduler.add(request)

    def _lora_adapter(self, lora_request: LoRARequest | None) -> Any:
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is "
                             f"not enabled (enable_lora=True / --enable-lora)")
        return self.lora.load(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (vLLM's ``add_lora``); later requests reuse it.

        Raises:
            ValueError: LoRA is off, or what is wrong with the adapter.
        """
        self._lora_adapter(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests running with it finish with their own copy."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.loaded()

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> Any:
        from inference_engine.detokenizer import IncrementalDetokenizer, NoTextDetokenizer

        if not params.detokenize:
            return NoTextDetokenizer()
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests in any state; returns their final outputs (unknown ids are skipped)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            # Never scheduled: held back, or waiting to fork from the first sample.
            for child in [*self.held.drop(rid),
                          *self.forks.take(group.children[0].request.request_id)]:
                child.request.status = RequestStatus.FINISHED
                child.request.finish_reason = FinishReason.ABORT
            for child in group.children:
                if self.structured.is_waiting(child.request.request_id):
                    # Never scheduled (its grammar was compiling): it finishes here.
                    self.structured.remove(child.request.request_id)
                    child.request.status = RequestStatus.FINISHED
                    child.request.finish_reason = FinishReason.ABORT
                else:
                    self.scheduler.abort(child.request.request_id)
            outputs.append(self._group_output(group))
            self._forget(group)
        return outputs

    def _forget(self, group: RequestGroup) -> None:
        """The group is reported finished: drop the engine's state of it."""
        group.reported_finished = True
        self._groups.pop(group.request_id, None)
        for child in group.children:
            self._sequences.pop(child.request.request_id, None)
            if self.spec is not None:
                self.spec.remove(child.request.request_id)
            self.structured.remove(child.request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._pending_outputs) or self._in_flight is not None

    def request_ids(self) -> list[str]:
        """Ids of the requests not yet finished (as given to :meth:`add_request`)."""
        return list(self._groups)

    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def pause(self) -> None:
        """Stop scheduling; running requests keep their cache and resume later."""
        self.scheduler.paused = True

    def resume(self) -> None:
        self.scheduler.paused = False

    @property
    def is_paused(self) -> bool:
        return self.scheduler.paused

    # ---- the step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns outputs of requests that changed.

        With async scheduling the step is launched before the previous one's sampled
        tokens are read back, and the outputs returned are the previous step's: the
        host's bookkeeping overlaps the device's work.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        touched: dict[str, RequestGroup] = {}
        for state in [*self.held.release(), *self.forks.orphans()]:
            self._submit(state.request)
        self._admit_compiled(touched)
        if self.multi_step is not None and self._run_greedy_window(touched):
            out = SchedulerOutput()
        else:
            out = self.scheduler.schedule()
        # Block diffusion's DENOISE slots run apart from the flat forward (see _denoise).
        denoise = [s for s in out.scheduled if s.is_denoise]
        if denoise:
            out.scheduled = [s for s in out.scheduled if not s.is_denoise]
        for request, error in out.failed:  # ended by the scheduler itself
            state = self._sequences[request.request_id]
            state.error = error
            touched[state.group.request_id] = state.group
        previous, self._in_flight = self._in_flight, None
        if not out.is_empty and previous is not None and self._needs_host_tokens(out):
            # Penalties, logprobs: this step needs every earlier token on the host.
            self._process(previous, touched)
            previous = None
            out.scheduled = [s for s in out.scheduled if not s.request.is_finished]
        if self.spec is not None:  # synchronous: verify, append, draft
            if not out.is_empty:
                self._run_speculative(out, touched)
            launched = None
        else:
            launched = self._launch(out, previous) if not out.is_empty else None
        if previous is not None:
            self._process(previous, touched)
        if launched is not None:
            if self.async_scheduling and launched.sampling:
                self._in_flight = launched
            else:
                self._process(launched, touched)
        if denoise:
            self._denoise(denoise, touched)
        for group in touched.values():
            if group.final_only and not group.finished:
                continue
            output = self._group_output(group)
            outputs.append(output)
            if output.finished:
                self._forget(group)
        if (out.is_empty and launched is None and previous is None
                and self.structured.num_waiting):
            self.structured.wait(timeout=0.05)  # nothing to run but grammars compiling
        return outputs

    def _make_multi_step(self) -> MultiStepPlanner | None:
        """The greedy-window planner where ``num_scheduler_steps > 1`` and the model has a
        window (``CausalLM.greedy_window``); None otherwise, chosen once here: not with
        speculative decoding, LoRA, a distributed engine, block diffusion or async
        scheduling (a step in flight holds the next token on the device)."""
        steps = self.config.scheduler.num_scheduler_steps
        if (steps < 2 or self.model.greedy_window is None or self.spec is not None
                or self.lora is not None or self.executor is not None
                or self.diffusion is not None or self.async_scheduling):
            return None
        return MultiStepPlanner(steps, self.scheduler, self.blocks)

    def _run_greedy_window(self, touched: dict[str, RequestGroup]) -> bool:
        """Run this step as a greedy window where :class:`MultiStepPlanner` allows: the
        model computes up to K tokens of the lone running request in one call, which are
        then applied one at a time with the usual stop checks (what follows a stop is
        dropped). Returns whether it ran."""
        if self._in_flight is not None or self.forks.num_waiting or self.structured.num_waiting:
            return False
        plan = self.multi_step.plan()
        if plan is None:
            return False
        request = plan.request
        state = self._sequences[request.request_id]
        block_ids = self.blocks.req_blocks[request.request_id]
        token_ids = self.model.greedy_window.run(
            request.all_token_ids[-1], request.num_computed_tokens, block_ids, plan.stop_ids,
            plan.num_steps)
        self.multi_step.num_windows += 1
        self.multi_step.num_window_tokens += len(token_ids)
        for token in token_ids:
            request.append_token(token)
            self.num_generated_tokens += 1
            self._check_stop(state, token)
            if request.is_finished:
                break
        touched[state.group.request_id] = state.group
        # Every token computed (its K/V written) but the last: the next step's input.
        self.scheduler.update_after_step(SchedulerOutput(
            [ScheduledRequest(request, len(token_ids), True, block_ids)]))
        return True

    def _denoise(self, scheduled: list[Any], touched: dict[str, RequestGroup]) -> None:
        """One decoder pass for each DENOISE slot; a block that finishes is COMMITted: its
        ids are appended with the usual stop checks (EOS, stop strings, max_tokens) and
        stream out; the scheduler then ENCODEs them (they are uncached tokens)."""
        for request, token_ids in self.diffusion.run(scheduled):
            state = self._sequences[request.request_id]
            for token in token_ids:
                if request.is_finished:
                    break
                request.append_token(token)
                self.num_generated_tokens += 1
                self._check_stop(state, token)
            touched[state.group.request_id] = state.group

    def _admit_compiled(self, touched: dict[str, RequestGroup]) -> None:
        """Schedule the sequences whose grammar is compiled; fail those it could not."""
        if not self.structured.num_waiting:
            return
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add(request)
        for request, error in failed:
            state = self._sequences[request.request_id]
            state.error = error
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.ABORT
            touched[state.group.request_id] = state.group

    @staticmethod
    def _needs_host_tokens(out: SchedulerOutput) -> bool:
        """Whether some request of ``out`` reads its earlier tokens or logprobs on the host
        (penalties, logprobs, prompt logprobs, a grammar, bad words), so the step cannot
        run ahead of them."""
        for s in out.scheduled:
            p = s.request.params
            if (p.logprobs is not None or p.prompt_logprobs is not None
                    or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                    or p.frequency_penalty != 0.0 or p.structured_outputs is not None
                    or p.bad_words_token_ids):
                return True
        return False

    def _launch(self, out: SchedulerOutput, previous: _StepInFlight | None) -> _StepInFlight:
        """Run ``out``'s forward and sampling on the device; the ids are read later."""
        from inference_engine.sampling.batch import SamplingBatch

        for s in out.scheduled:
            request = s.request
            if request.num_computed_tokens < request.num_prompt_tokens:
                group = self._sequences[request.request_id].group
                if (request.num_computed_tokens and request.num_preemptions == 0
                        and not group.num_cached_tokens):
                    group.num_cached_tokens = request.num_computed_tokens
        batch = StepBatch.from_scheduler(
            out, None,
            previous.source_rows if previous is not None else None,
            previous.sampled if previous is not None else None)
        if self.state_slots is not None:
            batch.state_slots = [self.state_slots.slot(s.request.request_id)
                                 for s in out.scheduled]
        if self.lora is not None:
            self.lora.prepare_step([s.request.lora for s in out.scheduled],
                                   [s.num_new_tokens for s in out.scheduled])
        logits = self.runner.execute_batch(batch)
        for i, prompt_logits in logits.prompt_logits.items():
            self._add_prompt_logprobs(out.scheduled[i], prompt_logits)
        self.scheduler.update_after_step(out)
        self.num_prompt_tokens_computed += sum(
            s.num_new_tokens for s in out.scheduled if not s.samples or s.num_new_tokens > 1
        )
        sampling = [self._sequences[out.scheduled[i].request.request_id]
                    for i in logits.sample_rows]
        sample_logits = logits.sample_logits
        forked = self._fork_at_prompt_end(sampling) if self.forks.num_waiting else []
        if forked:  # each sibling samples from its parent's row, with its own seed
            sampling += [state for state, _ in forked]
            # Pinned where the platform has it: a pageable upload would wait for the device.
            rows = torch.tensor([row for _, row in forked], dtype=torch.int64,
                                pin_memory=self.platform.pinned_memory())
            rows = rows.to(sample_logits.device, non_blocking=True)
            sample_logits = torch.cat([sample_logits, sample_logits.index_select(0, rows)])
        if not sampling:
            return _StepInFlight([], None, None, None, None)
        requests = [state.request for state in sampling]
        sample_batch = SamplingBatch.from_rows(
            [r.params for r in requests],
            # Pending tokens count: the seeded draw number and min_tokens are lengths.
            [OutputsWithPending(r.output_token_ids, r.num_pending_tokens) if r.num_pending_tokens
             else r.output_token_ids for r in requests],
            vocab_size=sample_logits.shape[1],
            device=sample_logits.device,
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            eos_token_ids=[r.eos_token_ids for r in requests],
            token_bitmask=self.structured.fill_bitmask([r.request_id for r in requests]),
        )
        result = self.sampler(sample_logits, sample_batch)
        host = torch.empty(len(sampling), dtype=torch.int64,
                           pin_memory=self.platform.pinned_memory())
        host.copy_(result.sampled_token_ids, non_blocking=True)
        event = self.platform.record_event()
        for request in requests:
            request.num_pending_tokens += 1
        source_rows = {r.request_id: row for row, r in enumerate(requests)}
        return _StepInFlight(sampling, result.sampled_token_ids, host, event, result.logprobs,
                             source_rows)

    def _fork_at_prompt_end(self, sampling: list[SequenceState]
                            ) -> list[tuple[SequenceState, int]]:
        """Fork the siblings of every sampling row whose forward just reached the end of its
        prompt (prompt_fork.py): each takes shares of the parent's blocks and copies of its
        partial block and state slot, made on the device now (after this step's forward,
        before any later one), and runs from the next step.

        Returns:
            ``(sibling, the parent's sampling row)`` of each forked sibling; a sibling with
            no free block, slot or sequence place is scheduled to compute the prompt itself.
        """
        forked: list[tuple[SequenceState, int]] = []
        block_pairs: list[tuple[int, int]] = []
        slot_pairs: list[tuple[int, int]] = []
        for row, parent in enumerate(sampling):
            request = parent.request
            if not (self.forks.has_siblings(request.request_id)
                    and self.forks.at_prompt_end(request)):
                continue
            for sibling in self.forks.take(request.request_id):
                child = sibling.request
                copies = None
                if self.scheduler.num_running < self.config.scheduler.max_num_seqs:
                    copies = self.blocks.fork(request.request_id, child.request_id,
                                              request.num_prompt_tokens)
                if copies is None:
                    self._submit(child)
                    continue
                block_pairs += copies
                if self.state_slots is not None:
                    slot_pairs.append((self.state_slots.slot(request.request_id),
                                       self.state_slots.slot(child.request_id)))
                child.num_computed_tokens = request.num_prompt_tokens
                self.scheduler.add_running(child)
                forked.append((sibling, row))
        self.runner.copy_caches(block_pairs, slot_pairs)
        self.num_forked_samples += len(forked)
        return forked

    def _run_speculative(self, out: SchedulerOutput, touched: dict[str, RequestGroup]) -> None:
        """One synchronous speculative step: the forward verifies each sampling request's
        drafts, the rejection sampler picks 1..k+1 tokens, rejected slots are rolled
        back, and the proposer drafts for the next step."""
        for s in out.scheduled:
            request = s.request
            if request.num_computed_tokens < request.num_prompt_tokens:
                group = self._sequences[request.request_id].group
                if (request.num_computed_tokens and request.num_preemptions == 0
                        and not group.num_cached_tokens):
                    group.num_cached_tokens = request.num_computed_tokens
        batch = StepBatch.from_scheduler(out)
        if self.lora is not None:
            self.lora.prepare_step([s.request.lora for s in out.scheduled],
                                   [s.num_new_tokens for s in out.scheduled])
        logits = self.runner.execute_batch(batch)
        self.spec.on_target_step([s.request.request_id for s in out.scheduled],
                                 batch.num_computed, batch.query_lens)
        for i, prompt_logits in logits.prompt_logits.items():
            self._add_prompt_logprobs(out.scheduled[i], prompt_logits)
        self.scheduler.update_after_step(out)
        self.num_prompt_tokens_computed += sum(
            s.num_new_tokens - s.num_spec_tokens for s in out.scheduled
            if not s.samples or s.num_new_tokens - s.num_spec_tokens > 1)
        sampled = [out.scheduled[i] for i in logits.sample_rows]
        if not sampled:
            return
        masks = [self.structured.draft_bitmask(s.request.request_id,
                                               s.request.spec_token_ids[:s.num_spec_tokens])
                 for s in sampled]
        verdict = self.spec.verify(logits.sample_logits, [s.request for s in sampled],
                                   [s.num_spec_tokens for s in sampled],
                                   masks if any(m is not None for m in masks) else None)
        drafting = []
        for row, s in enumerate(sampled):
            request = s.request
            state = self._sequences[request.request_id]
            num_appended = 0
            for j, token in enumerate(verdict.token_ids[row]):
                if request.is_finished:
                    break
                request.append_token(token)
                self.structured.accept(request.request_id, token)
                num_appended += 1
                if state.logprobs is not None and verdict.logprobs[row] is not None:
                    state.logprobs.append(verdict.logprobs[row][j])
                self.num_generated_tokens += 1
                self._check_stop(state, token)
            touched[state.group.request_id] = state.group
            if s.num_spec_tokens:
                # Accepted drafts: the tokens appended before the last one.
                self.scheduler.rollback_rejected(s, max(0, num_appended - 1))
            if not request.is_finished:
                drafting.append(request)
        if drafting:
            self.spec.propose(drafting, [self.blocks.req_blocks[r.request_id] for r in drafting],
                              self.max_model_len)

    def _process(self, step: _StepInFlight, touched: dict[str, RequestGroup]) -> None:
        """Read a launched step's sampled ids back and apply them (stops, outputs)."""
        if not step.sampling:
            return
        if step.event is not None:
            step.event.synchronize()
        token_ids = step.host.tolist()
        # Looked up once per step: this loop runs for every sampling row.
        accept = self.structured.accept if self.structured.num_active else None
        logprobs = step.logprobs
        check_stop = self._check_stop
        finished = RequestStatus.FINISHED
        num_applied = 0
        for row, state in enumerate(step.sampling):
            request = state.request
            if request.status is finished:
                # Ended (stop, abort) while this token was on the device: it is dropped.
                request.num_pending_tokens = 0
                continue
            token = token_ids[row]
            request.append_token(token)
            if accept is not None:
                accept(request.request_id, token)
            if state.logprobs is not None and logprobs is not None:
                state.logprobs.append(logprobs[row])
            num_applied += 1
            check_stop(state, token)
            if request.status is finished:
                request.num_pending_tokens = 0
            touched[state.group.request_id] = state.group
        self.num_generated_tokens += num_applied

    def _add_prompt_logprobs(self, scheduled: Any, logits: torch.Tensor) -> None:
        from inference_engine.sampling.logprobs import prompt_logprobs

        request = scheduled.request
        state = self._sequences[request.request_id]
        start = request.num_computed_tokens
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]
        # Row j predicts token start + j + 1; only prompt positions count, and a
        # recomputed (preempted) prefix is not counted twice.
        have = len(state.prompt_logprobs) - 1
        end = min(start + scheduled.num_new_tokens, request.num_prompt_tokens - 1)
        if end > have >= start:
            targets = request.prompt_token_ids[have + 1 : end + 1]
            state.prompt_logprobs.extend(
                prompt_logprobs(logits[have - start : end - start], targets,
                                request.params.prompt_logprobs, self.tokenizer)
            )

    def _check_stop(self, state: SequenceState, token: int) -> None:
        request = state.request
        detok = state.detokenizer
        params = request.params
        num_out = len(request.output_token_ids)
        stop_strings = params.stop
        if stop_strings or not state.group.final_only:
            detok.add_token(token)  # else _group_output catches up once, at the end
        if stop_strings and num_out >= params.min_tokens:
            from inference_engine.detokenizer import find_stop

            hit = find_stop(detok.text, state.checked_len, stop_strings,
                            params.include_stop_str_in_output)
            if hit is not None:
                text, stop = hit
                state.final_text = text
                self.scheduler.finish(request, FinishReason.STOP, stop)
                return
            state.checked_len = len(detok.text)
        if token in request.eos_token_ids and num_out > params.min_tokens - 1:
            stop_reason = token if token in (params.stop_token_ids or ()) else None
            self.scheduler.finish(request, FinishReason.STOP, stop_reason)
            detok.flush()
        elif num_out >= state.max_new_tokens or len(request.all_token_ids) >= self.max_model_len:
            self.scheduler.finish(request, FinishReason.LENGTH)
            detok.flush()

    def _group_output(self, group: RequestGroup) -> RequestOutput:
        completions = []
        error = None
        for child in group.children:
            request, detok = child.request, child.detokenizer
            if error is None:
                error = child.error
            missing = len(request.output_token_ids) - detok.num_output_tokens
            if missing > 0:  # a final_only request's text, decoded at once
                detok.add_tokens(request.output_token_ids[-missing:])
                if request.is_finished:
                    detok.flush()
            text = child.final_text
            if text is None:
                text = detok.text
                if not request.is_finished and request.params.stop:
                    text = text[: len(text) - child.stop_holdback(text)]
            tokens, chars = child.reported_tokens, child.reported_chars
            if group.delta:  # only what is new since this sequence's previous output
                child.reported_tokens = len(request.output_token_ids)
                child.reported_chars = len(text)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text[chars:],
                    token_ids=request.output_token_ids[tokens:],  # a slice is a copy already
                    logprobs=child.logprobs[tokens:] if child.logprobs is not None else None,
                    finish_reason=request.finish_reason.value if request.finish_reason else None,
                    stop_reason=request.stop_reason,
                )
            )
        prompt_logprobs = group.children[0].prompt_logprobs
        if group.delta:
            prompt_logprobs = None if group.reported_prompt else prompt_logprobs
            group.reported_prompt = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=group.num_cached_tokens,
            error=error,
        )

    # ---- stats ----------------------------------------------------------------
    def expert_load(self) -> dict[int, list[int]]:
        """MoE layer index -> (token, slot) assignments routed to each expert so far; counted
        under tensor/expert parallelism (the input an expert load balancer needs), else {}."""
        from inference_engine.distributed.expert_load import expert_load

        return expert_load(self.model)

    def stats(self) -> dict[str, Any]:
        load = self.expert_load()
        return {
            **({"expert_load": load} if load else {}),
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.blocks.usage,
            "prefix_cache_hit_rate": self.blocks.stats.hit_rate,
            "prefix_cache_queried_tokens": self.blocks.stats.queried_tokens,
            "prefix_cache_hit_tokens": self.blocks.stats.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_held_samples": self.held.num_held,
            # n > 1 samples that took their first sample's prompt caches instead of
            # computing the prompt (prompt_fork.py), and those waiting to.
            "num_forked_samples": self.num_forked_samples,
            "num_samples_awaiting_fork": self.forks.num_waiting,
            "generated_tokens": self.num_generated_tokens,
            # Multi-step greedy windows run (multi_step.py) and the tokens they produced.
            "num_greedy_windows": self.multi_step.num_windows if self.multi_step else 0,
            "num_greedy_window_tokens": (self.multi_step.num_window_tokens
                                         if self.multi_step else 0),
            **(self.spec.metrics.as_stats() if self.spec is not None else {}),
            "time": time.time(),
        }
