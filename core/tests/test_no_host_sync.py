"""The host-sync guard itself, then the sampler and an MoE layer run inside it."""

from __future__ import annotations

import types

import pytest
import torch
from inference_engine.interfaces.platform import Platform
from inference_engine.layers.moe import FusedMoE, align_block_size, fused_moe_reference
from inference_engine.layers.moe.layer import choose_moe_kernel
from inference_engine.sampling import Sampler, SamplingBatch
from inference_engine.sampling_params import SamplingParams
from inference_engine.testing_sync import HostSyncError, no_host_sync

# --------------------------------------------------------------------------- #
# The guard.
# --------------------------------------------------------------------------- #

SYNCS = {
    "Tensor.item": lambda t: t[0].item(),
    "Tensor.tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t[0] > 0),
    "if": lambda t: 1 if t.max() > 0 else 0,
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t[0]),
    "index": lambda t: [1, 2, 3, 4][t[0]],
    "range": lambda t: range(t[0]),
    "Tensor.cpu": lambda t: t.cpu(),
    "Tensor.numpy": lambda t: t.numpy(),
    "to(cpu)": lambda t: t.to("cpu"),
    "to(device=cpu)": lambda t: t.to(device=torch.device("cpu"), dtype=torch.float32),
    "torch.nonzero": lambda t: torch.nonzero(t),
    "Tensor.nonzero": lambda t: t.nonzero(),
    "torch.where(cond)": lambda t: torch.where(t > 1),
    "masked_select": lambda t: torch.masked_select(t, t > 1),
    "mask index": lambda t: t[t > 1],
    "unique": lambda t: torch.unique(t),
    "Tensor.unique": lambda t: t.unique(),
    "repeat_interleave": lambda t: torch.repeat_interleave(t),
    "repeat_interleave repeats": lambda t: t.repeat_interleave(t),
    "bincount": lambda t: torch.bincount(t),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_guard_raises_on_each_host_read(name):
    t = torch.arange(4) + 1
    with pytest.raises(HostSyncError), no_host_sync(cuda_debug=False):
        SYNCS[name](t)


def test_guard_names_the_call():
    t = torch.ones(3)
    with pytest.raises(HostSyncError, match=r"Tensor\.item"), no_host_sync(cuda_debug=False):
        t.sum().item()


def test_guard_allows_ordinary_ops_and_host_data_uploads():
    x = torch.randn(4, 8)
    with no_host_sync(cuda_debug=False):
        y = torch.softmax(x, dim=-1).topk(3, dim=-1).values
        z = torch.where(x > 0, x, 0.0).argmax(dim=-1)
        idx = torch.tensor([0, 2])          # host data ...
        idx = idx.to("cpu", non_blocking=True)  # ... may be copied
        w = x.index_select(0, idx).to(torch.float64)
        r = torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)
        s = torch.arange(3).repeat_interleave(2)
        x[torch.tensor([0, 1]), torch.tensor([1, 2])] = 0.0
        x.shape[0] + len(x)  # shapes are host values already
    assert y.shape == (4, 3) and z.shape == (4,) and w.dtype == torch.float64
    assert r.tolist() == [0, 1, 1, 2, 2, 2] and s.tolist() == [0, 0, 1, 1, 2, 2]


def test_guard_is_off_outside_the_block():
    t = torch.ones(2)
    with no_host_sync(cuda_debug=False):
        pass
    assert t.sum().item() == 2.0


def test_guard_allow_marks_tensors_as_host_data():
    t = torch.arange(3)
    with no_host_sync(cuda_debug=False) as guard:
        guard.allow(t)
        t.cpu()
        t.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_guard_turns_on_cuda_sync_debug_mode():
    x = torch.ones(4, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with no_host_sync():
        assert torch.cuda.get_sync_debug_mode() == 2
        with pytest.raises(RuntimeError):
            torch.nonzero(x).cpu()
    assert torch.cuda.get_sync_debug_mode() == before


# --------------------------------------------------------------------------- #
# Sampling.
# --------------------------------------------------------------------------- #

VOCAB = 50


def _mixed_rows() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.1, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05, seed=11),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.3, top_k=3, seed=5),
        SamplingParams(temperature=0.0, top_k=4),
        SamplingParams(temperature=1.0, top_k=VOCAB + 5),
    ]


@pytest.mark.parametrize("rows", ["mixed", "greedy", "top_k_only", "seeded_only", "penalties"])
def test_sampling_inside_the_guard_matches_outside(rows):
    params = {
        "mixed": _mixed_rows(),
        "greedy": [SamplingParams(temperature=0.0)] * 3,
        "top_k_only": [SamplingParams(top_k=k) for k in (1, 4, 9, 0)],
        "seeded_only": [SamplingParams(seed=s, top_p=0.9) for s in range(4)],
        "penalties": [SamplingParams(repetition_penalty=1.3, min_tokens=5, seed=1),
                      SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, top_k=4),
                      SamplingParams(temperature=0.0, repetition_penalty=1.1)],
    }[rows]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0))
    outputs = [[1, 2, 3]] * len(params)
    batch = SamplingBatch.from_rows(params, outputs, VOCAB, prompt_token_ids=[[4, 5]] * len(params),
                                    eos_token_ids=[[2]] * len(params))
    expected = Sampler(seed=1).sample_ids(logits, batch)
    with no_host_sync(cuda_debug=False):
        got = Sampler(seed=1).sample_ids(logits, batch)
    assert torch.equal(got, expected)
    assert torch.equal(got, Sampler(seed=1)(logits, batch).sampled_token_ids)


def test_from_rows_uploads_parameters_in_one_copy(monkeypatch):
    copies = []
    original = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        copies.append((args, kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    batch = SamplingBatch.from_rows(_mixed_rows(), [[1, 2]] * 10, VOCAB)
    assert len(copies) == 1 and copies[0][1] == {"non_blocking": True}
    assert batch.top_k.dtype == torch.int64 and batch.max_top_k == 7
    assert batch.temperature.dtype == torch.float32 and batch.is_greedy.dtype == torch.bool
    assert batch.is_greedy.tolist() == [True] + [False] * 7 + [True, False]


# --------------------------------------------------------------------------- #
# MoE.
# --------------------------------------------------------------------------- #


def _moe_layer(num_experts: int = 6, hidden: int = 16, inter: int = 12) -> FusedMoE:
    ctx = types.SimpleNamespace(quant_method=types.SimpleNamespace(fused_moe_method=lambda p: None),
                                dtype=torch.float32, device=torch.device("cpu"))
    layer = FusedMoE(ctx, num_experts, hidden, inter, "model.layers.0.mlp.experts")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.gate_up_proj.copy_(0.2 * torch.randn(layer.gate_up_proj.shape, generator=g))
        layer.down_proj.copy_(0.2 * torch.randn(layer.down_proj.shape, generator=g))
    return layer


def test_moe_forward_inside_the_guard():
    layer = _moe_layer()
    assert layer.kernel == "torch"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])  # experts 3..5 get nothing
    weights = torch.rand(ids.shape, generator=g)
    with no_host_sync(cuda_debug=False):
        out = layer(x, weights, ids)
    torch.testing.assert_close(out, fused_moe_reference(
        x, layer.gate_up_proj, layer.down_proj, weights, ids), atol=1e-5, rtol=1e-5)


def test_align_block_size_inside_the_guard():
    ids = torch.tensor([[2, 0], [2, 2], [0, 2]])
    with no_host_sync(cuda_debug=False):
        sorted_ids, block_expert, num_padded = align_block_size(ids, 4, 4)
    assert sorted_ids.numel() == 16  # the bound 6 + 4 * 3, in whole blocks of 4
    assert num_padded.tolist() == [8]


class _FakeGpu(Platform):
    name = "fake_gpu"
    device_type = "cuda"

    def __init__(self) -> None:  # no device facts needed
        self.device_ids = [0]

    def moe_kernels(self) -> list[str]:
        return ["triton", "torch"]


def test_moe_kernel_comes_from_the_platform_list():
    gpu = _FakeGpu()
    assert choose_moe_kernel(torch.device("cuda", 0), gpu) == "triton"
    # Weights on another device than the platform's: the portable path.
    assert choose_moe_kernel(torch.device("cpu"), gpu) == "torch"
    assert choose_moe_kernel(torch.device("cpu"), None) == "torch"
