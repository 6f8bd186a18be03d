"""Registrations of inference-engine-parsers; targets stay strings until used."""

from __future__ import annotations

from inference_engine import Spec, hookimpl

_PKG = "inference_engine_parsers"


@hookimpl
def ie_register_tool_parsers() -> list[Spec]:
    return [
        Spec("qwen3", f"{_PKG}.qwen3:Qwen3ToolParser",
             "Qwen3/Qwen2.5 hermes JSON in <tool_call>"),
        Spec("qwen3_coder", f"{_PKG}.qwen3_coder:Qwen3CoderToolParser",
             "Qwen3-Coder/Qwen3.5 XML <function=…><parameter=…>"),
        Spec("glm45", f"{_PKG}.glm:Glm45ToolParser",
             "GLM-4.5/4.6 <tool_call>NAME<arg_key>…<arg_value>…"),
        Spec("glm47", f"{_PKG}.glm:Glm47ToolParser",
             "GLM-4.7, GLM-5 <tool_call>NAME<arg_key>…<arg_value>…"),
        Spec("minimax_m2", f"{_PKG}.minimax_m2:MiniMaxM2ToolParser",
             "MiniMax-M2/M2.1/M2.5 <minimax:tool_call><invoke name=…>"),
        Spec("nemotron_v2", f"{_PKG}.nemotron_v2:NemotronV2ToolParser",
             "Nemotron Nano v2 JSON array in <TOOLCALL>"),
        Spec("nemotron_v3", f"{_PKG}.qwen3_coder:NemotronV3ToolParser",
             "Nemotron 3 Nano/Super (qwen3_coder XML grammar)"),
        Spec("deepseek_v31", f"{_PKG}.deepseek_v31:DeepSeekV31ToolParser",
             "DeepSeek-V3.1 <｜tool▁calls▁begin｜> envelope"),
    ]


@hookimpl
def ie_register_reasoning_parsers() -> list[Spec]:
    return [
        Spec("qwen3", f"{_PKG}.reasoning:Qwen3ReasoningParser",
             "<think>…</think>, thinking on by default"),
        Spec("glm45", f"{_PKG}.reasoning:Glm45ReasoningParser",
             "GLM-4.5…GLM-5 <think>…</think>, thinking on by default"),
        Spec("minimax_m2", f"{_PKG}.reasoning:MiniMaxM2ReasoningParser",
             "MiniMax-M2 …</think>, always thinking"),
        Spec("minimax_m2_append_think", f"{_PKG}.reasoning:MiniMaxM2AppendThinkReasoningParser",
             "MiniMax-M2: no split, content is '<think>' + output"),
        Spec("nemotron_v3", f"{_PKG}.reasoning:NemotronV3ReasoningParser",
             "Nemotron 3 <think>…</think>; reasoning becomes content when off and empty"),
        Spec("deepseek_r1", f"{_PKG}.reasoning:DeepSeekR1ReasoningParser",
             "DeepSeek-R1 <think>…</think>, always thinking"),
        Spec("deepseek_v3", f"{_PKG}.reasoning:DeepSeekV3ReasoningParser",
             "DeepSeek-V3.1 <think>…</think>, off unless thinking=true"),
    ]
