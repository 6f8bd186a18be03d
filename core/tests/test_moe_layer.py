"""Fused MoE: the router against transformers' routers, the torch path and the Triton
grouped GEMM (under TRITON_INTERPRET=1, fp32) against the plain reference."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
import transformers
from inference_engine.layers.moe import (
    ExpertActivation,
    RouterSpec,
    align_block_size,
    fused_moe_reference,
    fused_moe_torch,
    route,
    sort_by_expert,
)

ACTIVATIONS = [ExpertActivation("silu"), ExpertActivation("swigluoai"),
               ExpertActivation("gelu_tanh"), ExpertActivation("relu2")]


def problem(t: int, k_in: int, inter: int, e: int, seed: int = 0,
            act: ExpertActivation = ACTIVATIONS[0]):
    """Inputs and weights; a non-gated ``act`` gets up rows alone (``[E, I, K]``)."""
    g = torch.Generator().manual_seed(seed)
    rows = act.up_rows(inter)
    x = torch.randn(t, k_in, generator=g)
    gate_up = 0.2 * torch.randn(e, rows, k_in, generator=g)
    down = 0.2 * torch.randn(e, k_in, inter, generator=g)
    biases = (torch.randn(e, rows, generator=g), torch.randn(e, k_in, generator=g))
    return x, gate_up, down, biases


CASES = {
    # experts 3..5 receive nothing
    "empty_experts": torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]]),
    # one token routed to every expert, others to one each
    "one_token_many_experts": torch.tensor([[0, 1, 2, 3, 4, 5], [5, 5, 5, 5, 5, 5]]),
    "single_token": torch.tensor([[3, 1]]),
}


def _triton_module():
    import inference_engine.layers.moe.triton_moe as module

    return module


def check_triton_against_reference() -> None:
    """Every case, both activations, with and without biases; then hook-chosen block sizes.

    Runs in a fresh interpreter with ``TRITON_INTERPRET=1`` (see the test below).
    """
    triton_moe = _triton_module()
    for ids in CASES.values():
        for act in ACTIVATIONS:
            for bias in (False, True):
                x, gate_up, down, (gb, db) = problem(ids.shape[0], 40, 24, 6, act=act)
                weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
                args = (x, gate_up, down, weights, ids, act) + ((gb, db) if bias else (None, None))
                torch.testing.assert_close(triton_moe.fused_moe_triton(*args),
                                           fused_moe_reference(*args), atol=1e-5, rtol=1e-5)
    seen = []

    def tuned(op_name, shape, default):
        seen.append((op_name, dict(shape)))
        return {**default, "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16,
                "GROUP_SIZE_M": 2}

    triton_moe.tuning_config = tuned
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (37, 2), generator=g)
    x, gate_up, down, _ = problem(37, 48, 40, 5)
    weights = torch.rand(ids.shape, generator=g)
    torch.testing.assert_close(triton_moe.fused_moe_triton(x, gate_up, down, weights, ids),
                               fused_moe_reference(x, gate_up, down, weights, ids),
                               atol=1e-5, rtol=1e-5)
    assert seen[0] == ("fused_moe", {"M": 37, "N": 80, "K": 48, "E": 5, "topk": 2}), seen


def test_triton_kernel_matches_reference_under_the_interpreter():
    """Triton binds the interpreter when it is first imported, so this runs in a child process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "triton ok" in done.stdout


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("bias", [False, True])
def test_torch_path_matches_reference(case, act, bias):
    ids = CASES[case]
    x, gate_up, down, (gb, db) = problem(ids.shape[0], 40, 24, 6, act=act)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    args = (x, gate_up, down, weights, ids, act) + ((gb, db) if bias else (None, None))
    torch.testing.assert_close(fused_moe_torch(*args), fused_moe_reference(*args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,hf_name", [("relu2", "relu2"), ("gelu_tanh", "gelu_pytorch_tanh"),
                                          ("silu", "silu")])
def test_expert_activations_match_transformers(name, hf_name):
    """Each activation against transformers' ACT2FN of the same name (gated ones on the gate
    half, times the up half); a non-gated one keeps the width."""
    from inference_engine.layers.moe import expert_activation
    from transformers.activations import ACT2FN

    act = ExpertActivation(name)
    h = torch.randn(5, 2 * 8, generator=torch.Generator().manual_seed(0))
    if act.gated:
        want = ACT2FN[hf_name](h[:, :8]) * h[:, 8:]
    else:
        want = ACT2FN[hf_name](h)
    torch.testing.assert_close(expert_activation(h.clone(), act), want)
    torch.testing.assert_close(expert_activation(h.clone(), act, inplace=True), want)


def test_align_block_size_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 2], [0, 2]])
    sorted_ids, block_expert, num_padded = align_block_size(ids, 4, 4)
    # Static sizes: 6 assignments + 4 experts * 3 spare rows, in whole blocks of 4.
    assert sorted_ids.shape == (16,) and block_expert.shape == (4,)
    assert num_padded.tolist() == [8] and block_expert.tolist() == [0, 2, 0, 0]
    # Expert 0: assignments 1 and 4, then padding (6); expert 2: 0, 2, 3, 5; unused rows.
    assert sorted_ids.tolist() == [1, 4, 6, 6, 0, 2, 3, 5] + [6] * 8
    d = sort_by_expert(ids, 4)
    assert d.counts.tolist() == [2, 0, 4, 0] and d.token_of.tolist() == [0, 2, 0, 1, 1, 2]
    assert d.ends.tolist() == [2, 2, 6, 6] and d.sorted_experts.tolist() == [0, 0, 2, 2, 2, 2]


# --------------------------------------------------------------------------- #
# Routers against the transformers modules they replace.
# --------------------------------------------------------------------------- #


def _hf_router(cls_path: str, **config: object):
    module_name, _, cls_name = cls_path.rpartition(".")
    cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), cls_name)
    router = cls(types.SimpleNamespace(**config))
    with torch.no_grad():
        router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.1)
    return router


def _check(hf_weights, hf_ids, weights, ids):
    order_hf, order = hf_ids.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order_hf.values, order.values)
    torch.testing.assert_close(hf_weights.float().gather(1, order_hf.indices),
                               weights.gather(1, order.indices), atol=1e-6, rtol=1e-6)


def test_softmax_topk_renormalised_matches_qwen3_moe():
    hf = _hf_router("qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", num_experts_per_tok=2,
                    num_experts=8, norm_topk_prob=True, hidden_size=16)
    x = torch.randn(11, 16)
    _, w_hf, i_hf = hf(x)
    w, i = route(x @ hf.weight.T, RouterSpec(8, 2, "softmax", renormalize=True))
    _check(w_hf, i_hf, w, i)


def test_topk_softmax_matches_granitemoe():
    hf = _hf_router("granitemoe.modeling_granitemoe.GraniteMoeTopKRouter", num_local_experts=8,
                    num_experts_per_tok=3, hidden_size=16)
    x = torch.randn(11, 16)
    _, w_hf, i_hf = hf(x)
    w, i = route(x @ hf.weight.T, RouterSpec(8, 3, "topk_softmax"))
    _check(w_hf, i_hf, w, i)


def test_sigmoid_grouped_with_correction_bias_matches_glm4_moe():
    hf = _hf_router("glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter", num_experts_per_tok=3,
                    num_local_experts=16, hidden_size=16, routed_scaling_factor=2.5, n_group=4,
                    topk_group=2, norm_topk_prob=True)
    x = torch.randn(23, 16)
    _, w_hf, i_hf = hf(x)
    spec = RouterSpec(16, 3, "sigmoid", renormalize=True, num_groups=4, topk_groups=2,
                      group_score="top2_sum", routed_scaling_factor=2.5)
    w, i = route(x @ hf.weight.T, spec, hf.e_score_correction_bias)
    _check(w_hf, i_hf, w, i)


def test_group_limited_greedy_matches_deepseek_v2():
    hf = _hf_router("deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
                    num_experts_per_tok=3, num_experts=16, hidden_size=16,
                    routed_scaling_factor=1.5, topk_method="group_limited_greedy", n_group=4,
                    topk_group=2)
    x = torch.randn(23, 16)
    _, w_hf, i_hf = hf(x)
    spec = RouterSpec(16, 3, "softmax", num_groups=4, topk_groups=2, group_score="max",
                      routed_scaling_factor=1.5)
    _check(w_hf, i_hf, *route(x @ hf.weight.T, spec))


def test_router_rejects_bad_specs():
    with pytest.raises(ValueError, match="top_k"):
        RouterSpec(4, 5)
    with pytest.raises(ValueError, match="multiple"):
        RouterSpec(6, 2, num_groups=4)
    with pytest.raises(ValueError, match="scoring"):
        RouterSpec(4, 2, "relu")  # type: ignore[arg-type]


def test_transformers_is_v5():
    assert int(transformers.__version__.split(".")[0]) >= 5


if __name__ == "__main__":
    check_triton_against_reference()
    print("triton ok")
