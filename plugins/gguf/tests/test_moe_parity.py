"""MoE architectures end to end: transformers -> GGUF (llama.cpp's layout) -> the engine.

For granitemoe, deepseek2 (MLA; DeepSeek-V2 and V3), glm4moe (with an MTP block to
skip), minimax-m2 and gpt-oss: a tiny random transformers model is exported by
:func:`~inference_engine_gguf.export.export_to_gguf` and loaded by ``LLM``. The
reference is the transformers model holding exactly the values the file stores
(dequantized by the ``gguf`` package). Last-position logits of a prefill batch
must agree within 1e-4, and greedy continuations must be equal (a difference
only at a genuine near-tie of the reference, top-2 within 1e-4).
"""

from __future__ import annotations

import gguf
import pytest
import torch
import transformers
from gguf.constants import GGMLQuantizationType as T
from inference_engine import LLM, SamplingParams
from inference_engine.layers.moe.activation import gated_activation
from inference_engine.testing import cpu_llm
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.export import DEEPSEEK2_BEFORE_KV_B_SPLIT, export_to_gguf
from inference_engine_gguf.gguf_file import GGUFFile
from inference_engine_gguf.moe_method import GGMLFusedMoEMethod, expert_linear
from inference_engine_gguf.testing import block32_matmul_reference, q8k_matmul_reference

NEW_TOKENS = 6
PROMPTS = ["The quick brown fox", "héllo wörld, naïve café"]
SMALL_KV = 1 << 22
# K = 256 along every matrix a K-quant case quantizes (hidden, o_proj, expert widths).
COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512)

# model_type -> (config class, model class, config overrides, GGUF architecture,
#                the engine model's MoE module name)
ARCHS = {
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.09,
        logits_scaling=2.0), "granitemoe", "block_sparse_moe"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64, head_dim=32, routed_scaling_factor=1.5,
        topk_method="greedy", norm_topk_prob=False), "deepseek2", "mlp"),
    # llama.cpp writes DeepSeek-V3 as deepseek2 (sigmoid gating, exp_probs_b).
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64, head_dim=32, routed_scaling_factor=2.5,
        n_group=2, topk_group=1, norm_topk_prob=True), "deepseek2", "mlp"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=256, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=True, num_nextn_predict_layers=1), "glm4moe", "mlp"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, rotary_dim=32),
        "minimax-m2", "block_sparse_moe"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=64)), "gpt-oss", "mlp"),
}


def k_quant(qtype: T):
    """``qtype`` where rows allow it (K % 256), else Q8_0 (K % 32), else F16, as llama.cpp
    falls back for rows a K-quant cannot hold."""

    def choose(name: str, shape: tuple[int, ...]) -> T:
        k = shape[-1]
        return qtype if k % 256 == 0 else T.Q8_0 if k % 32 == 0 else T.F16

    return choose


def gpt_oss_mxfp4(name: str, shape: tuple[int, ...]) -> T:
    """gpt-oss as released: MXFP4 experts, the rest Q8_0."""
    return T.MXFP4 if ".experts." in name else T.Q8_0


# case -> (model_type, GGML type or chooser, config overrides on top of ARCHS')
CASES = {
    "granitemoe-F16": ("granitemoe", T.F16, {}),
    # Granite-3 MoE ties the LM head to the embedding (no output.weight in the file).
    "granitemoe-Q4_K-tied": ("granitemoe", k_quant(T.Q4_K), {"tie_word_embeddings": True}),
    "deepseek2-F32": ("deepseek_v2", T.F32, {}),
    # DeepSeek-V2 proper: low-rank q, group-limited routing, YaRN with mscale (the
    # file's yarn_log_multiplier). Not norm_topk_prob=True: transformers' DeepseekV2
    # ignores it, while llama.cpp and the engine renormalise.
    "deepseek2-Q8_0-V2": ("deepseek_v2", T.Q8_0, dict(
        q_lora_rank=128, n_group=2, topk_group=1, topk_method="group_limited_greedy",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                             original_max_position_embeddings=64, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707))),
    "deepseek2-F16-whole-kv_b": ("deepseek_v2", T.F16, {}),
    "deepseek3-F16": ("deepseek_v3", T.F16, {}),
    "deepseek3-Q8_0": ("deepseek_v3", T.Q8_0, {}),
    "glm4moe-F16": ("glm4_moe", T.F16, {}),
    "glm4moe-Q4_K": ("glm4_moe", k_quant(T.Q4_K), {}),
    "minimax-m2-F16": ("minimax_m2", T.F16, {}),
    "minimax-m2-Q8_0": ("minimax_m2", T.Q8_0, {}),
    "gpt-oss-F16": ("gpt_oss", T.F16, {}),
    "gpt-oss-MXFP4": ("gpt_oss", gpt_oss_mxfp4, {}),
    # No YaRN keys in the file: plain RoPE, not transformers' GptOssConfig default YaRN.
    "gpt-oss-F16-plain-rope": ("gpt_oss", T.F16, {"rope_parameters": dict(
        rope_type="default", rope_theta=150000.0)}),
    "granitemoe-Q4_1": ("granitemoe", T.Q4_1, {}),
}

# Cases written by an older converter.
EXPORT_OPTIONS = {"deepseek2-F16-whole-kv_b": {"layout": DEEPSEEK2_BEFORE_KV_B_SPLIT}}


def make_model(model_type: str, tokenizer, seed: int, **extra):
    """A random float32 transformers model of ``model_type`` (every weight and buffer drawn)."""
    config_name, model_name, overrides, _, _ = ARCHS[model_type]
    overrides = {**overrides, **extra}
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    params = {**COMMON, "vocab_size": len(tokenizer), "tie_word_embeddings": False,
              "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
              "pad_token_id": tokenizer.pad_token_id, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**params)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # a wider spread than the default init: decisive greedy picks
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:  # biases, attention sinks
                p.normal_(0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer):
    """case -> (transformers model with the stored weights, path of its GGUF file)."""
    cache: dict[str, tuple[torch.nn.Module, str]] = {}

    def get(case: str):
        if case not in cache:
            model_type, qtype, extra = CASES[case]
            model = make_model(model_type, tokenizer, seed=len(case), **extra)
            path = tmp_path_factory.mktemp(case) / "model.gguf"
            stored = export_to_gguf(model, tokenizer, path, qtype,
                                    **EXPORT_OPTIONS.get(case, {}))
            missing = model.load_state_dict({**model.state_dict(), **stored}, strict=True)
            assert not missing.missing_keys and not missing.unexpected_keys
            model.generation_config.eos_token_id = None
            cache[case] = (model, str(path))
        return cache[case]

    return get


def load(path: str, **kwargs) -> LLM:
    """The exact product with the file's values (``activations=float``), as transformers runs."""
    return cpu_llm(path, dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV,
               quant_options={"activations": "float"}, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_last_position_logits_match_transformers(case, exported, tokenizer):
    model, path = exported(case)
    llm = load(path)
    engine = llm.engine
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    for i, ids in enumerate(prompt_ids):
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1),
                           request_id=f"p{i}")
    step = engine.scheduler.schedule()
    blocks = [engine.blocks.req_blocks[s.request.request_id] for s in step.scheduled]
    logits = engine.runner.execute(step, blocks)
    assert len(logits.sample_rows) == len(PROMPTS)
    for row, index in enumerate(logits.sample_rows):
        ids = step.scheduled[index].request.prompt_token_ids
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1].float()
        assert ref.std() > 0.1  # not a degenerate comparison
        err = float((logits.sample_logits[row] - ref).abs().max())
        assert err < 1e-4, f"{case}: last-position logits differ by {err:.2e}"
    engine.abort_request([f"p{i}" for i in range(len(PROMPTS))])
    # Only the model's own layers were built (GLM's MTP block is skipped), and the
    # experts of the last layer hold the file's GGML blocks.
    layers = engine.model.model.layers
    assert len(layers) == model.config.num_hidden_layers
    experts = getattr(layers[-1], ARCHS[CASES[case][0]][4]).experts
    assert type(experts.quant_method).__name__ == "GGMLFusedMoEMethod"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(case, exported, tokenizer):
    model, path = exported(case)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(model, prompt_ids, NEW_TOKENS)
    llm = load(path)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for ids, out, expected in zip(prompt_ids, outs, ref, strict=True):
        assert_greedy_matches(model, ids, list(out.outputs[0].token_ids), expected)


@pytest.mark.parametrize("case", ["gpt-oss-MXFP4"])
def test_dequantize_at_load_gives_the_same_tokens(case, exported, tokenizer):
    model, path = exported(case)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [[list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)]
        for llm in (load(path), load(path, dequantize_at_load=True))]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("case", list(CASES))
def test_file_is_laid_out_as_llama_cpp_writes_it(case, exported):
    """The names and keys llama.cpp's loader looks for (a guard on the exporter itself)."""
    model, path = exported(case)
    model_type = CASES[case][0]
    file = GGUFFile(path)
    arch = ARCHS[model_type][3]
    assert file.architecture == arch
    names = set(file.tensors)
    # Every tensor is one llama.cpp's loader knows for this architecture.
    known = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch))] for b in range(4)}
    assert {n.rsplit(".", 1)[0] for n in names} <= known
    last = model.config.num_hidden_layers - 1
    assert {f"blk.{last}.ffn_gate_exps.weight", f"blk.{last}.ffn_up_exps.weight",
            f"blk.{last}.ffn_down_exps.weight", f"blk.{last}.ffn_gate_inp.weight"} <= names
    whole_kv_b = case in EXPORT_OPTIONS
    assert ("blk.0.attn_kv_b.weight" in names) == whole_kv_b
    expected = {
        "deepseek2": {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_shexp.weight"} | (
            set() if whole_kv_b else {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"}),
        "glm4moe": {"blk.1.exp_probs_b.bias", "blk.0.post_attention_norm.weight",
                    "blk.2.nextn.eh_proj.weight", "blk.2.nextn.shared_head_head.weight",
                    "blk.2.ffn_gate_exps.weight"},
        "minimax-m2": {"blk.0.exp_probs_b.bias", "blk.0.attn_q_norm.weight"},
        "gpt-oss": {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias",
                    "blk.0.ffn_up_exps.bias", "blk.0.ffn_down_exps.bias"},
        "granitemoe": set(),
    }[arch]
    assert expected <= names
    assert ("output.weight" in names) != model.config.tie_word_embeddings
    if arch == "deepseek2" and not whole_kv_b:
        assert file.get("deepseek2.attention.head_count_kv") == 1
        assert file.get("deepseek2.attention.key_length") == 128 + 32
        assert file.get("deepseek2.attention.key_length_mla") == 64
        assert file.get("deepseek2.leading_dense_block_count") == 1
    if arch == "glm4moe":
        assert file.get("glm4moe.block_count") == 3
        assert file.get("glm4moe.nextn_predict_layers") == 1
        assert file.get("glm4moe.rope.dimension_count") == 32
    if arch == "minimax-m2":
        assert file.get("minimax-m2.rope.dimension_count") == 32
    if arch == "gpt-oss":
        assert file.get("gpt-oss.attention.sliding_window") == 6


def expert_linear_reference(x: torch.Tensor, raw: torch.Tensor, qtype: T
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's matmul of one expert in numpy (float64), and the error-bound magnitudes
    (for F16 / BF16, float32 sums of K products: scaled by K / 16, so 2^-20 of it is K
    float32 roundings)."""
    if qtype in q8k_kernels.Q8K_TYPES:
        return q8k_matmul_reference(x, raw, qtype)
    if qtype in q8k_kernels.Q8_TYPES:
        return block32_matmul_reference(x, raw, qtype)
    half = {T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
    xs, w = x.to(half).double(), raw.double()
    return xs @ w.t(), xs.abs() @ w.abs().t() * (x.shape[-1] / 16)


def within_bound(ours: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    """The error as a multiple of its bound (exact integer sums, a few float32 roundings)."""
    return ((ours.double() - ref).abs() / (magnitude * 2**-20 + 1e-30)).max().item()


def experts_reference(layer, x, weights, ids):
    """Token by token, slot by slot: both expert matmuls by the reference, biases, the
    gated activation, the routing weight. The down matmul's input is the activation of
    the layer's own first product (checked against the reference first): computed from
    the reference's instead, an input within float rounding of an 8-bit step could round
    the other way."""
    method = layer.quant_method
    gate_up_bias = getattr(layer, "gate_up_proj_bias", None)
    down_bias = getattr(layer, "down_proj_bias", None)
    out = torch.zeros(x.shape[0], layer.down_proj.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            xt = x[t : t + 1].float()
            h = expert_linear(xt, layer.gate_up_proj[e], method.gate_up_type)
            h_ref, h_magnitude = expert_linear_reference(xt, layer.gate_up_proj[e],
                                                         method.gate_up_type)
            assert within_bound(h, h_ref, h_magnitude) <= 1.0
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].float()
            act = gated_activation(h.float(), layer.activation)
            y, magnitude = expert_linear_reference(act, layer.down_proj[e], method.down_type)
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += w * y[0]
            bound[t] += abs(w) * magnitude[0]
    return out, bound


@pytest.mark.parametrize("case", ["gpt-oss-MXFP4", "glm4moe-Q4_K", "granitemoe-Q4_1",
                                  "granitemoe-F16"])
def test_q8_experts_multiply_as_llamacpp(case, exported, tokenizer):
    """The default ``activations=q8``: each MoE layer's routed experts, through a whole
    generate, equal llama.cpp's arithmetic for their types (MXFP4 / Q8_0 / Q8_1 / Q8_K
    activations and integer dots, F16 activations for F16) stated in numpy."""
    _, path = exported(case)
    llm = cpu_llm(path, dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV)
    layers = [m for m in llm.engine.model.modules()
              if isinstance(getattr(m, "quant_method", None), GGMLFusedMoEMethod)]
    assert layers and all(m.quant_method.uses_q8(m) for m in layers)
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args, out)))
             for m in layers]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS], params,
                 use_tqdm=False)
    for hook in hooks:
        hook.remove()
    assert len(calls) >= 2 * len(layers)  # the prefill and a decode step
    for layer, (x, weights, ids), out in calls:
        ref, bound = experts_reference(layer, x, weights, ids)
        excess = within_bound(out, ref, bound)
        assert excess <= 1.0, f"{case}: error {excess:.2f}x the bound"
