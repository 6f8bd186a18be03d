"""The offline Python API, shaped like vLLM's ``LLM`` so users can switch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from inference_engine.config import EngineConfig
from inference_engine.distributed.dp_frontend import make_engine
from inference_engine.engine.llm_engine import LLMEngine, PromptInput
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import RequestOutput
from inference_engine.sampling_params import SamplingParams

__all__ = ["LLM", "apply_chat_template", "truncate_prompt"]


class LLM:
    """Load a model once; generate for batches of prompts.

    Keywords are the engine's (``dtype``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``kv_cache_memory``,
    ``device_ids``, ``attention_backend``, ``quantization``, ``enable_lora``,
    ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ...).

    ``reasoning_parser`` (a registered name, as vLLM's engine argument): structured
    outputs (``SamplingParams.structured_outputs``) then apply once the model has closed
    its reasoning section, as on the server.
    """

    def __init__(self, model: str, show_progress: bool = True,
                 reasoning_parser: str | None = None, **kwargs: Any) -> None:
        self.reasoning_parser_cls = None
        if reasoning_parser is not None:
            from inference_engine.plugins import get_plugins

            # Before the model loads, so an unknown name fails fast (UnknownNameError).
            self.reasoning_parser_cls = get_plugins().registry.resolve("reasoning_parsers",
                                                                       reasoning_parser)
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        # One LLMEngine, or (data_parallel_size > 1 under mp / ray) the front end of several.
        self.engine = make_engine(self.config, show_progress=show_progress)
        self.show_progress = show_progress

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        enable_thinking: bool | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order.

        ``lora_request``: one adapter for every prompt, or a list with one (or None) per
        prompt (needs ``enable_lora=True``). ``enable_thinking``: whether the prompts leave
        the model in its reasoning section (None: the reasoning parser's default); only
        read with a ``reasoning_parser``.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        engine = self.engine
        prompts = [truncate_prompt(engine, prompt, params.truncate_prompt_tokens)
                   for prompt, params in zip(prompts, params_list, strict=True)]
        params_list = [self._after_reasoning(prompt, params, enable_thinking)
                       for prompt, params in zip(prompts, params_list, strict=True)]
        base = f"llm-{id(self)}-{engine.num_unfinished_requests()}-"
        ids = []
        try:
            for i, (prompt, params, lora) in enumerate(zip(prompts, params_list, loras,
                                                           strict=True)):
                ids.append(engine.add_request(prompt, params, request_id=f"{base}{i}",
                                              final_only=True, lora_request=lora))
        except Exception:
            engine.abort_request(ids)
            raise
        show = self.show_progress if use_tqdm is None else use_tqdm
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not show or len(ids) < 2,
                  leave=False) as bar:
            while len(finished) < len(ids):
                for output in engine.step():
                    if output.finished and output.request_id not in finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the tokenizer's, or ``chat_template``: a Jinja text) to
        each conversation and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.engine.tokenizer, conv, tools,
                                                     add_generation_prompt, chat_template_kwargs,
                                                     chat_template)}
            for conv in conversations
        ]
        from inference_engine.parsing import thinking_from_kwargs

        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             enable_thinking=thinking_from_kwargs(chat_template_kwargs))

    def _after_reasoning(self, prompt: PromptInput, params: SamplingParams,
                         enable_thinking: bool | None) -> SamplingParams:
        """``params`` with its structured output moved after the reasoning section when
        the output starts inside one: a reasoning parser is set, its thinking is on for
        this prompt, and the prompt has not already closed the section (vLLM's
        ``is_reasoning_end`` on the prompt)."""
        cls = self.reasoning_parser_cls
        marker = getattr(cls, "end_marker", None)
        if cls is None or not marker or params.structured_outputs is None:
            return params
        if not getattr(cls(tokenizer=self.engine.tokenizer, enable_thinking=enable_thinking),
                       "is_thinking", False):
            return params
        text, ids = self.engine.tokenize_prompt(prompt)
        if text is None:
            text = self.engine.tokenizer.decode(ids)
        start = getattr(cls, "start_marker", "")
        if marker in text and text.rfind(marker) > (text.rfind(start) if start else -1):
            return params  # the prompt itself ended the reasoning (thinking switched off)
        from inference_engine.structured_output.reasoning import after_reasoning

        return dataclasses.replace(params, structured_outputs=after_reasoning(
            params.structured_outputs, marker))


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of a conversation rendered by ``chat_template`` (a Jinja text) or else
    the tokenizer's chat template.

    Raises:
        ValueError: no template given and the tokenizer has none.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; pass a plain prompt instead")
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def truncate_prompt(engine: LLMEngine, prompt: PromptInput, keep: int | None) -> PromptInput:
    """``prompt`` cut to its last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``; -1:
    as many as leave room for one output token); unchanged when ``keep`` is None."""
    if keep is None:
        return prompt
    _, token_ids = engine.tokenize_prompt(prompt)
    if keep == -1:
        keep = engine.max_model_len - 1
    return {"prompt_token_ids": token_ids[-keep:]}
