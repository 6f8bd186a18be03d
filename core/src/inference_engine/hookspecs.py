"""Every hook the engine calls on its plugins; nothing else lives here.

Registration hooks return lists of light :class:`~inference_engine.registry.Spec`
records whose targets are ``"module:attr"`` strings, so discovering plugins
imports no heavy code. Decision hooks are ``firstresult``: the first non-None
answer wins, and plugins must not rely on call order for correctness.
Call every hook with keyword arguments only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from inference_engine.registry import Spec

PROJECT_NAME = "inference_engine"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]


# --------------------------------------------------------------------------- #
# Registration hooks: called once per process when the registry loads.
# --------------------------------------------------------------------------- #


@hookspec
def ie_register_platforms() -> list[Spec]:
    """Register hardware platforms.

    Called once when the registry loads, in every process that needs it.

    Returns:
        Specs whose targets are :class:`~inference_engine.interfaces.platform.Platform`
        subclasses. The spec name is the value of ``--platform`` (``cpu``, ``cuda``).
    """


@hookspec
def ie_register_models() -> list[Spec]:
    """Register model architectures.

    Called once when the registry loads.

    Returns:
        Specs named exactly as the architecture appears in a Hugging Face
        ``config.json`` ``architectures`` list (``Qwen3ForCausalLM``); targets
        are model classes built by the model runner.
    """


@hookspec
def ie_register_quantization_methods() -> list[Spec]:
    """Register quantization methods.

    Called once when the registry loads.

    Returns:
        Specs named as ``--quantization`` accepts them (``fp8``, ``ptpc_fp8``);
        targets are :class:`~inference_engine.interfaces.quant.QuantMethod`
        subclasses.
    """


@hookspec
def ie_register_attention_backends() -> list[Spec]:
    """Register attention backends.

    Called once when the registry loads.

    Returns:
        Specs named as ``--attention-backend`` accepts them (``paged``,
        ``torch_sdpa``); targets are
        :class:`~inference_engine.interfaces.attention.AttentionBackend` subclasses.
    """


@hookspec
def ie_register_weight_formats() -> list[Spec]:
    """Register checkpoint weight formats.

    Called once when the registry loads.

    Returns:
        Specs named by format (``safetensors``, ``gguf``); targets are
        :class:`~inference_engine.interfaces.weight_format.WeightFormat` subclasses.
    """


@hookspec
def ie_register_tool_parsers() -> list[Spec]:
    """Register streaming tool-call parsers.

    Called once when the registry loads.

    Returns:
        Specs named as ``--tool-call-parser`` accepts them (``qwen3``);
        targets are :class:`~inference_engine.interfaces.parsers.ToolParser` subclasses.
    """


@hookspec
def ie_register_reasoning_parsers() -> list[Spec]:
    """Register streaming reasoning parsers.

    Called once when the registry loads.

    Returns:
        Specs named as ``--reasoning-parser`` accepts them (``qwen3``);
        targets are :class:`~inference_engine.interfaces.parsers.ReasoningParser`
        subclasses.
    """


@hookspec
def ie_register_proposers() -> list[Spec]:
    """Register speculative-decoding drafters (proposers).

    Called once when the registry loads.

    Returns:
        Specs named as ``--speculative-config``'s ``method`` accepts them (``ngram``,
        ``draft_model``); targets are
        :class:`~inference_engine.interfaces.proposer.Proposer` subclasses.
    """


# --------------------------------------------------------------------------- #
# Decision hooks: firstresult, the first non-None answer wins.
# --------------------------------------------------------------------------- #


@hookspec(firstresult=True)
def ie_kernel_tuning_config(
    op_name: str, platform: Any, shape: dict[str, int]
) -> dict[str, Any] | None:
    """Answer a kernel's launch configuration for one problem.

    Called by a kernel (fused MoE, FP8 GEMM, ...) before it launches, usually
    once per distinct shape (the caller caches the answer).

    Args:
        op_name: the kernel's name, e.g. ``"fused_moe"`` or ``"fp8_gemm"``.
        platform: the current :class:`~inference_engine.interfaces.platform.Platform`
            instance; ask it questions (``platform.arch_name()``), do not branch on
            its class.
        shape: the problem size, e.g. ``{"M": 64, "N": 4096, "K": 4096, "E": 8}``.

    Returns:
        A dict of launch parameters (``BLOCK_SIZE_M``, ``num_warps``, ...), or
        None to let another plugin (or the kernel's default) answer. The first
        non-None answer wins.
    """


@hookspec(firstresult=True)
def ie_detect_weight_format(path: str) -> str | None:
    """Say which weight format a checkpoint path is in.

    Called when a model path is opened, before any format is resolved, so a
    format can be named (and a missing plugin reported) even when the plugin
    that would load it is not installed.

    Args:
        path: the model path as given by the user (a folder or a file).

    Returns:
        The weight format's registered name (``"gguf"``), or None if this
        plugin does not recognise the path. The first non-None answer wins.
    """
