"""The offline Python API, shaped like vLLM's ``LLM`` so users can switch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from inference_engine.config import EngineConfig
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
    """

    def __init__(self, model: str, show_progress: bool = True, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self.show_progress = show_progress

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order.

        ``lora_request``: one adapter for every prompt, or a list with one (or None) per
        prompt (needs ``enable_lora=True``).
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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


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
