"""Registrations of inference-engine-models; targets stay strings until used."""

from __future__ import annotations

from inference_engine import Spec, hookimpl


@hookimpl
def ie_register_models() -> list[Spec]:
    base = "inference_engine_models"
    return [
        Spec("LlamaForCausalLM", f"{base}.llama:LlamaForCausalLM", "Llama 2/3 dense decoder"),
        Spec("Qwen2ForCausalLM", f"{base}.qwen2:Qwen2ForCausalLM", "Qwen2 / Qwen2.5 dense decoder"),
        Spec("Qwen3ForCausalLM", f"{base}.qwen3:Qwen3ForCausalLM",
             "Qwen3 dense decoder (q/k norm)"),
        Spec("Qwen3MoeForCausalLM", f"{base}.qwen3_moe:Qwen3MoeForCausalLM",
             "Qwen3-MoE (softmax top-k routing)"),
        Spec("GraniteMoeForCausalLM", f"{base}.granitemoe:GraniteMoeForCausalLM",
             "GraniteMoE (Granite multipliers, top-k softmax routing)"),
        Spec("Glm4MoeForCausalLM", f"{base}.glm4_moe:Glm4MoeForCausalLM",
             "GLM-4.5/4.6 MoE (sigmoid grouped routing, shared experts, partial rotary)"),
        Spec("MiniMaxM2ForCausalLM", f"{base}.minimax_m2:MiniMaxM2ForCausalLM",
             "MiniMax-M2 (all-head q/k norm, sigmoid routing, partial rotary)"),
        Spec("GptOssForCausalLM", f"{base}.gpt_oss:GptOssForCausalLM",
             "gpt-oss (attention sinks, sliding-window layers, clamped SwiGLU experts)"),
        Spec("DeepseekV2ForCausalLM", f"{base}.deepseek_v2:DeepseekV2ForCausalLM",
             "DeepSeek-V2 (multi-head latent attention, softmax-routed MoE)"),
        Spec("DeepseekV3ForCausalLM", f"{base}.deepseek_v3:DeepseekV3ForCausalLM",
             "DeepSeek-V3 / R1 (MLA, sigmoid noaux_tc routing with correction bias)"),
        Spec("DeepseekV32ForCausalLM", f"{base}.deepseek_v32:DeepseekV32ForCausalLM",
             "DeepSeek-V3.2 (DSA: lightning indexer, top-k sparse MLA)"),
        Spec("GlmMoeDsaForCausalLM", f"{base}.glm_moe_dsa:GlmMoeDsaForCausalLM",
             "GLM-5 (DSA sparse MLA, indexer shared across layers)"),
        Spec("DeepseekV4ForCausalLM", f"{base}.deepseek_v4:DeepseekV4ForCausalLM",
             "DeepSeek-V4 (sliding K=V attention + compressed CSA/HCA entries, "
             "hyper-connections, hash-routed MoE)"),
        Spec("NemotronHForCausalLM", f"{base}.nemotron_h:NemotronHForCausalLM",
             "Nemotron-H / Nemotron 3 (Mamba-2, attention, relu2 MoE and MLP hybrid)"),
        Spec("MiniMaxM3VLForCausalLM", f"{base}.minimax_m3:MiniMaxM3VLForCausalLM",
             "MiniMax-M3 text (MSA block-sparse GQA layers, SwiGLU-OAI sigmoid-routed MoE)"),
        Spec("DiffusionGemmaForBlockDiffusion",
             f"{base}.diffusion_gemma:DiffusionGemmaForBlockDiffusion",
             "DiffusionGemma block diffusion, text (causal encoder + canvas denoiser, Gemma-4 MoE)"),
        Spec("WhisperForConditionalGeneration", f"{base}.whisper:WhisperForConditionalGeneration",
             "Whisper speech recognition (encoder once per 30 s window, paged decoder)"),
        Spec("MiniMaxM3SparseForConditionalGeneration",
             f"{base}.minimax_m3:MiniMaxM3SparseForConditionalGeneration",
             "MiniMax-M3 VL checkpoint, text-only (vision tower skipped)"),
    ]
