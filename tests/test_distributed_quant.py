"""Block-quantized checkpoints under tensor parallelism (gloo, 2 ranks): one process's tokens.

An MXFP4 checkpoint (gpt-oss-style ``weight_blocks``/``weight_scales`` written from the
spec's formula by :mod:`inference_engine_quant.mx_testing`), a ModelOpt NVFP4 one (same
helpers) and a GGUF file (written by the
``gguf`` package through the plugin's exporter, K-quants of 256-value superblocks) run
with ``LLM(tensor_parallel_size=2)`` (the mp executor: this process is rank 0, one spawned
worker rank 1): column-parallel layers keep their rows with their scales / superblocks,
row-parallel layers their whole blocks of K. Their greedy tokens equal the same engine on
one process, itself tested against transformers on the dequantized weights in
plugins/quant/tests/test_mxfp4.py and plugins/gguf/tests/test_model_parity.py. A shard
that would cut a block is refused by name before anything runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm, train_tiny_tokenizer
from inference_engine.testing_parity import PARITY_PROMPTS, randomize, tiny_dense_config

ENGINE_ARGS = dict(max_num_batched_tokens=24, block_size=4, kv_cache_memory=4 << 20, seed=0,
                   dtype="float32")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = PARITY_PROMPTS[:3]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


def _hf_model(tokenizer, **overrides):
    import transformers

    config = tiny_dense_config("qwen3", len(tokenizer), **overrides)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    torch.manual_seed(0)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.1)


def _mxfp4_checkpoint(root: Path, tokenizer, **overrides) -> Path:
    """Every decoder linear layer MXFP4 (attention included, so q/k/v are split by rows and
    o_proj by blocks of K); embeddings and LM head dense."""
    from inference_engine_quant.mx_testing import ref_mxfp4, write_quantized_checkpoint

    model = _hf_model(tokenizer, **overrides)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")

    def quantize(module, w):
        blocks, scales, deq = ref_mxfp4(w)
        return {".weight_blocks": blocks, ".weight_scales": scales}, deq

    config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.embed_tokens", "lm_head"]}
    write_quantized_checkpoint(root / "base", root / "q", root / "dq", quantize, config)
    return root / "q"


def _nvfp4_checkpoint(root: Path, tokenizer, **overrides) -> Path:
    """A ModelOpt NVFP4 checkpoint (16-value blocks with E4M3 scales, one global scale per
    tensor) of every decoder linear layer; the LM head excluded."""
    from inference_engine_quant.mx_testing import ref_nvfp4, write_quantized_checkpoint

    model = _hf_model(tokenizer, **overrides)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")

    def quantize(module, w):
        packed, block_scales, global_scale, deq = ref_nvfp4(w)
        return {".weight": packed, ".weight_scale": block_scales,
                ".weight_scale_2": global_scale}, deq

    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                 "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
    write_quantized_checkpoint(root / "base", root / "q", root / "dq", quantize,
                               hf_quant_config=hf_quant)
    return root / "q"


def _gguf_file(path: Path, tokenizer, qtype, **overrides) -> Path:
    from inference_engine_gguf.export import export_to_gguf

    export_to_gguf(_hf_model(tokenizer, **overrides).float(), tokenizer, path, qtype)
    return path


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """Roughly llama.cpp's Q4_K_M: Q6_K for v, down and the head, Q8_0 embeddings, else Q4_K."""
    if "embed_tokens" in name:
        return T.Q8_0
    return T.Q6_K if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else T.Q4_K


def _tokens(model: Path, **kwargs) -> tuple[list[list[int]], object]:
    llm = cpu_llm(model, **ENGINE_ARGS, **kwargs)
    try:
        layer = llm.engine.model.model.layers[0]
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], layer
    finally:
        llm.engine.shutdown()


def test_mxfp4_checkpoint_under_tp2_gives_one_process_tokens(tmp_path, tokenizer):
    # o_proj K = 4 heads x 16 = 64 and down_proj K = 128: 32 and 64 columns per rank,
    # whole 32-value blocks.
    path = _mxfp4_checkpoint(tmp_path, tokenizer, head_dim=16)
    one, _ = _tokens(path)
    two, layer = _tokens(path, tensor_parallel_size=2)
    assert layer.mlp.down_proj.linear_format.name == "mxfp4"
    # Rank 0 holds half of K's blocks of down_proj and half the rows of gate/up.
    assert tuple(layer.mlp.down_proj.weight_blocks.shape) == (64, 2, 16)
    assert tuple(layer.mlp.gate_up_proj.weight_scales.shape) == (128, 2)
    assert two == one


def test_modelopt_nvfp4_checkpoint_under_tp2_gives_one_process_tokens(tmp_path, tokenizer):
    # o_proj K = 64 and down_proj K = 128: 32 and 64 columns per rank, whole 16-value blocks;
    # each part's global scale is a scalar both ranks keep.
    path = _nvfp4_checkpoint(tmp_path, tokenizer, head_dim=16)
    one, _ = _tokens(path)
    two, layer = _tokens(path, tensor_parallel_size=2)
    assert layer.mlp.down_proj.linear_format.name == "nvfp4"
    assert tuple(layer.mlp.down_proj.weight_scale.shape) == (64, 4)
    assert two == one


def test_gguf_k_quants_under_tp2_give_one_process_tokens(tmp_path, tokenizer):
    # Row-parallel K (o_proj: 4 heads x 128, down_proj: 512) splits into whole 256-value
    # superblocks: one per rank.
    path = _gguf_file(tmp_path / "m.gguf", tokenizer, q4_k_m, hidden_size=256,
                      intermediate_size=512, head_dim=128)
    # activations=float: the exact product with the file's values (as the parity tests
    # compare); llama.cpp's q8 activation rounding flips near-ties either way when the
    # float inputs differ in the last bits (summation order of the all-reduce).
    options = {"quant_options": {"activations": "float"}}
    one, _ = _tokens(path, **options)
    two, layer = _tokens(path, tensor_parallel_size=2, **options)
    down = layer.mlp.down_proj
    assert [s.qtype for s in down.gguf_segments] == [T.Q6_K] and down.input_size == 256
    assert [s.qtype for s in layer.self_attn.qkv_proj.gguf_segments] == [T.Q4_K, T.Q6_K]
    assert two == one


def _moe_checkpoint(root: Path, tokenizer, **overrides) -> Path:
    import transformers
    from inference_engine.testing_parity import MOE_CONFIGS

    config = MOE_CONFIGS["qwen3_moe"](len(tokenizer))
    for key, value in overrides.items():
        setattr(config, key, value)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    torch.manual_seed(0)
    randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.1).save_pretrained(
        root / "base")
    tokenizer.save_pretrained(root / "base")
    return root / "base"


def test_fp8_block_experts_placed_over_two_expert_parallel_ranks(tmp_path, tokenizer):
    """FP8 block-scaled Qwen3-MoE experts (``inference-engine quantize --method fp8-block``)
    placed whole over 2 EP ranks (2 DP ranks), each loading its experts' weights and block
    scales: one process's tokens. Split across TP, experts 32 wide would cut a 128-block."""
    from inference_engine_quant.quantize_cli import quantize_checkpoint

    quantize_checkpoint(_moe_checkpoint(tmp_path, tokenizer), tmp_path / "fp8", "fp8-block",
                        show_progress=False)
    path = tmp_path / "fp8"
    one, _ = _tokens(path)
    # Two DP ranks (attention whole on each: its 64-wide projections are one FP8 block)
    # with the experts over both: the data-parallel front end, MoE in lockstep.
    two, layer = _tokens(path, data_parallel_size=2, enable_expert_parallel=True)
    experts = layer.mlp.experts
    assert type(experts.quant_method).__name__ == "Fp8FusedMoEMethod"
    assert experts.gate_up_proj.shape[0] == 4 and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert two == one
    with pytest.raises(ValueError, match=r"mlp\.experts: Fp8FusedMoEMethod experts keep blocks "
                                         r"of 128 intermediate values whole, but "
                                         r"tensor_parallel_size 2 gives each rank 16 of 32"):
        cpu_llm(path, tensor_parallel_size=2, **ENGINE_ARGS)


def test_fp8_block_experts_split_across_two_tp_ranks(tmp_path, tokenizer):
    """Each expert's intermediate width (256) split over 2 TP ranks in whole 128-blocks: the
    per-expert weights by rows (gate/up) and columns (down), their block scales by blocks.
    Attention 4 x 64 heads and 4 KV heads keep every FP8 shard a whole number of blocks."""
    from inference_engine_quant.quantize_cli import quantize_checkpoint

    base = _moe_checkpoint(tmp_path, tokenizer, hidden_size=256, moe_intermediate_size=256,
                           num_experts=4, head_dim=64, num_key_value_heads=4)
    quantize_checkpoint(base, tmp_path / "fp8", "fp8-block", show_progress=False)
    one, _ = _tokens(tmp_path / "fp8")
    two, layer = _tokens(tmp_path / "fp8", tensor_parallel_size=2)
    experts = layer.mlp.experts
    assert tuple(experts.down_proj.shape) == (4, 256, 128)  # this rank's half of I
    assert two == one


def test_online_mxfp4_experts_split_across_two_tp_ranks(tmp_path, tokenizer):
    """``--quantization mxfp4`` (online) on Qwen3-MoE experts 64 wide: each TP rank quantizes
    its 32 columns of down (one whole 32-value block) and its rows of gate/up, as one process
    would; attention and experts MXFP4, tokens equal one process's."""
    base = _moe_checkpoint(tmp_path, tokenizer, moe_intermediate_size=64)
    one, _ = _tokens(base, quantization="mxfp4")
    two, layer = _tokens(base, quantization="mxfp4", tensor_parallel_size=2)
    experts = layer.mlp.experts
    assert type(experts.quant_method).__name__ == "Mxfp4FusedMoEMethod"
    assert tuple(experts.down_proj_blocks.shape) == (8, 64, 1, 16)
    assert two == one


def test_gpt_oss_mxfp4_experts_split_across_two_tp_ranks(tmp_path, tokenizer):
    """A gpt-oss MXFP4 checkpoint (experts 64 wide, stored [E, in, out] with gate/up rows
    interleaved, packed as ``*_blocks``/``*_scales`` from the spec's formula; biased experts,
    attention sinks, sliding-window layers) under TP=2: each rank de-interleaves, keeps its
    rows of gate/up and its 32-value block of down, its heads' sinks, and the down bias on
    rank 0 only; one process's tokens."""
    import json

    import transformers
    from inference_engine_quant.mx_testing import ref_mxfp4
    from safetensors.torch import load_file, save_file

    config = transformers.GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=5,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    path = tmp_path / "q"
    randomize(transformers.GptOssForCausalLM(config), std=0.1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))

    def packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [E, rows, K]
        e, rows, k = w.shape
        blocks, scales, _ = ref_mxfp4(w.reshape(e * rows, k))
        return blocks.reshape(e, rows, k // 32, 16), scales.reshape(e, rows, k // 32)

    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        for part in ("gate_up_proj", "down_proj"):  # rows stay interleaved for gate_up
            w = state.pop(f"{p}.{part}").transpose(1, 2).contiguous()
            state[f"{p}.{part}_blocks"], state[f"{p}.{part}_scales"] = packed(w)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    one, _ = _tokens(path)
    two, layer = _tokens(path, tensor_parallel_size=2)
    assert tuple(layer.mlp.experts.down_proj_blocks.shape) == (4, 64, 1, 16)
    assert tuple(layer.self_attn.sinks.shape) == (2,)
    assert two == one


@pytest.mark.parametrize(("kind", "message"), [
    ("mxfp4", r"mlp\.down_proj: MXFP4 blocks hold 32 input values, but tensor_parallel_size 2 "
              r"gives each rank 48 of the 96"),
    ("gguf", r"o_proj: GGUF Q4_K blocks hold 256 input values, but tensor_parallel_size 2 "
             r"gives each rank 128 of the 256"),
])
def test_a_shard_that_cuts_a_block_is_refused_by_name(tmp_path, tokenizer, kind, message):
    if kind == "mxfp4":
        path = _mxfp4_checkpoint(tmp_path, tokenizer, intermediate_size=96, head_dim=16)
    else:
        path = _gguf_file(tmp_path / "m.gguf", tokenizer, T.Q4_K, hidden_size=256,
                          intermediate_size=512, head_dim=64)
    with pytest.raises(ValueError, match=message):
        cpu_llm(path, tensor_parallel_size=2, **ENGINE_ARGS)
