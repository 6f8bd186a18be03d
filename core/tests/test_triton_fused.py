"""The Triton fused small ops against their torch references, and the build-time choice.

``triton.jit`` decides at import whether it interprets, so the kernel cases run in a
child pytest with ``TRITON_INTERPRET=1`` (as in the quant plugin's Triton tests), in
float32 (bf16 is broken in the interpreter); the bf16 bit-for-bit cases need a GPU.
In this process the wrapper and the choice tests run: layers built under a platform
whose ``fused_op_kernels()`` starts with ``"triton"`` bind the Triton functions, CPU
binds the C++ ones, and a device that is not the platform's keeps the old fall-through.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from inference_engine.builtin.quant.unquantized import UnquantizedMethod  # noqa: E402
from inference_engine.interfaces.model import ModelContext  # noqa: E402
from inference_engine.layers import triton_fused  # noqa: E402
from inference_engine.layers.decoder import DecoderForCausalLM  # noqa: E402
from inference_engine.layers.fused_op_choice import choose_fused_op  # noqa: E402
from inference_engine.layers.mlp import GatedMLP, silu_and_mul_cpu, silu_and_mul_torch  # noqa: E402
from inference_engine.layers.norm import RMSNorm, rms_norm_cpu, rms_norm_torch  # noqa: E402
from inference_engine.layers.rotary import (  # noqa: E402
    RotaryEmbedding,
    RotaryTable,
    rope_parameters,
    rotate_cpu,
    rotate_torch,
)
from inference_engine.platforms.selection import set_current_platform  # noqa: E402
from inference_engine.testing import run_under_triton_interpreter  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6

interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    stdout = run_under_triton_interpreter(__file__)
    # Only the wrapper and the GPU case skip there.
    assert "2 skipped" in stdout and "failed" not in stdout, stdout[-2000:]


# --------------------------------------------------------------------------- #
# Platforms that only list kernels
# --------------------------------------------------------------------------- #


class ListingPlatform:
    """A stand-in platform: a device type and a ``fused_op_kernels()`` list."""

    def __init__(self, kernels: list[str], device_type: str = "cpu") -> None:
        self.kernels = kernels
        self.device_type = device_type

    def fused_op_kernels(self) -> list[str]:
        return list(self.kernels)


@pytest.fixture
def platform_listing():
    """Make a :class:`ListingPlatform` the process's platform; unset it afterwards."""

    def use(kernels: list[str], device_type: str = "cpu") -> ListingPlatform:
        platform = ListingPlatform(kernels, device_type)
        set_current_platform(platform)  # type: ignore[arg-type]
        return platform

    yield use
    set_current_platform(None)


def make_ctx(config=None) -> ModelContext:
    from inference_engine.testing_parity import BACKENDS

    return ModelContext(config, torch.float32, UnquantizedMethod(), BACKENDS["torch_sdpa"],
                        torch.device("cpu"))


def tiny_rope(head_dim: int = 64, partial: float = 1.0) -> RotaryEmbedding:
    import transformers

    config = transformers.LlamaConfig(head_dim=head_dim, partial_rotary_factor=partial)
    return RotaryEmbedding(head_dim, 512, rope_parameters(config), torch.float32)


class TinyQwen3(DecoderForCausalLM):
    """The dense decoder with Qwen3's per-head q/k norm."""

    qk_norm = True


def tiny_config(partial: float = 1.0):
    from inference_engine.testing_parity import tiny_dense_config

    return tiny_dense_config("llama", head_dim=16, partial_rotary_factor=partial)


# --------------------------------------------------------------------------- #
# The choice, made once at build (runs in both processes: no kernel is launched)
# --------------------------------------------------------------------------- #


def test_choice_follows_the_platform_list_for_its_own_device():
    cpu = torch.device("cpu")
    assert choose_fused_op(cpu, ListingPlatform(["triton", "torch"])) == "triton"
    assert choose_fused_op(cpu, ListingPlatform(["cpu", "torch"])) == "cpu"
    assert choose_fused_op(cpu, ListingPlatform(["torch"])) == "torch"
    assert choose_fused_op(cpu, ListingPlatform(["some_future_kernel"])) == "torch"
    # Tensors on another device type than the platform's: the old self-guarding path.
    assert choose_fused_op(cpu, ListingPlatform(["triton", "torch"], "cuda")) == "cpu"
    assert choose_fused_op(None, ListingPlatform(["triton", "torch"])) == "cpu"


def test_no_usable_platform_keeps_the_cpu_fall_through(monkeypatch):
    import inference_engine.platforms.selection as selection

    def no_platform():
        raise IndexError("no platform present")

    monkeypatch.setattr(selection, "current_platform", no_platform)
    assert choose_fused_op(torch.device("cpu")) == "cpu"


def test_layers_built_under_a_triton_platform_bind_the_triton_kernels(platform_listing):
    from inference_engine.layers import decoder

    platform_listing(["triton", "torch"])
    norm = RMSNorm(32, EPS, torch.float32)
    assert norm.fused_op == "triton" and norm._rms_norm is triton_fused.rms_norm
    mlp = GatedMLP(make_ctx(), 16, 24, "mlp")
    assert mlp.fused_op == "triton" and mlp._silu_and_mul is triton_fused.silu_and_mul
    rope = tiny_rope()
    assert rope.fused_op == "triton" and rope._rotate_qk is triton_fused.rotary_qk
    assert rope.lookup(torch.tensor([1, 2])).impl is triton_fused.rotary
    model = TinyQwen3(make_ctx(tiny_config()))
    attn = model.model.layers[0].self_attn
    assert attn._norm_rotate_qk is decoder._norm_heads_rotate_qk_triton
    assert {m.fused_op for m in model.modules() if hasattr(m, "fused_op")} == {"triton"}


def test_layers_built_on_the_cpu_platform_bind_the_cpu_kernels(platform_listing):
    from inference_engine.layers import decoder

    platform_listing(["cpu", "torch"])
    assert RMSNorm(32, EPS, torch.float32)._rms_norm is rms_norm_cpu
    assert GatedMLP(make_ctx(), 16, 24, "mlp")._silu_and_mul is silu_and_mul_cpu
    assert tiny_rope().lookup(torch.tensor([1])).impl is rotate_cpu
    attn = TinyQwen3(make_ctx(tiny_config())).model.layers[0].self_attn
    assert attn._norm_rotate_qk is decoder._norm_heads_rotate_qk_cpu


def test_torch_only_platform_binds_the_torch_references(platform_listing):
    from inference_engine.layers import decoder

    platform_listing(["torch"])
    assert RMSNorm(32, EPS, torch.float32)._rms_norm is rms_norm_torch
    assert tiny_rope().lookup(torch.tensor([1])).impl is rotate_torch
    attn = TinyQwen3(make_ctx(tiny_config())).model.layers[0].self_attn
    assert attn._norm_rotate_qk is decoder._norm_heads_rotate_qk_torch
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    layer = RMSNorm(32, EPS, torch.float32)
    out, summed = layer(x, residual)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)


# --------------------------------------------------------------------------- #
# Kernels against the torch references (interpreter, float32)
# --------------------------------------------------------------------------- #


@interp
@pytest.mark.parametrize("width", [24, 80, 2048])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_reference(width, rows, with_residual):
    torch.manual_seed(width + rows)
    wide = torch.randn(rows, width + 8) * 3
    x = wide[:, 4:4 + width]  # a column slice: rows are strided
    weight = 1.0 + 0.3 * torch.randn(width)
    residual = torch.randn(rows, width) if with_residual else None
    got = triton_fused.rms_norm(x, weight, EPS, residual)
    ref = rms_norm_torch(x, weight, EPS, residual)
    if with_residual:
        torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)  # the residual stream
        got, ref = got[0], ref[0]
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("head_dim", [24, 128])
def test_rms_norm_with_per_head_weights(head_dim):
    """Qwen3's q/k norm: ``x [T, heads, D]`` (strided heads of a fused projection) with a
    ``[heads, D]`` weight (q's weight on the q heads, k's on the k heads)."""
    heads, kv_heads, t = 4, 2, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    q_w, k_w = torch.randn(head_dim), torch.randn(head_dim)
    stacked = torch.cat((q_w.expand(heads, -1), k_w.expand(kv_heads, -1)))
    got = triton_fused.rms_norm(qk, stacked, EPS)
    torch.testing.assert_close(got, rms_norm_torch(qk, stacked, EPS), atol=1e-5, rtol=1e-5)
    # The [D] weight on [T, H, D] is the same weight on every head.
    torch.testing.assert_close(triton_fused.rms_norm(qk, q_w, EPS),
                               rms_norm_torch(qk, q_w, EPS), atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("inter", [24, 80, 1500])
@pytest.mark.parametrize("rows", [1, 5])
def test_silu_and_mul_equals_reference(inter, rows):
    torch.manual_seed(inter)
    wide = torch.randn(rows, 2 * inter + 6) * 4
    gate_up = wide[:, :2 * inter]  # strided rows
    gate_up[0, 0] = -120.0  # exp(-gate) overflows: silu -> -0
    got = triton_fused.silu_and_mul(gate_up)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, silu_and_mul_torch(gate_up), atol=1e-5, rtol=1e-5)


POSITIONS = torch.tensor([0, 1, 7, 100, 511, 3])


@interp
@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (64, 0.5), (80, 1.0), (80, 0.25),
                                              (32, 0.75)])
def test_rotary_equals_reference(head_dim, partial):
    rope = tiny_rope(head_dim, partial)
    table = rope.lookup(POSITIONS)
    x = torch.randn(len(POSITIONS), 9, head_dim)[:, 2:7]  # strided heads
    got = triton_fused.rotary(table, x)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, rotate_torch(table, x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[..., table.rot_dim:], x[..., table.rot_dim:], atol=0, rtol=0)


@interp
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_of_q_and_k_in_one_launch(partial):
    head_dim, heads, kv_heads = 64, 4, 2
    rope = tiny_rope(head_dim, partial)
    t = len(POSITIONS)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, :heads * head_dim]  # flat [T, H * D] column slices
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim]
    got_q, got_k = triton_fused.rotary_qk(rope.lookup(POSITIONS), q, k)
    table = rope.lookup(POSITIONS)
    ref_q = rotate_torch(table, q.reshape(t, heads, head_dim)).view(q.shape)
    ref_k = rotate_torch(table, k.reshape(t, kv_heads, head_dim)).view(k.shape)
    torch.testing.assert_close(got_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k, atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (80, 0.5)])
def test_qk_norm_and_rotary_in_one_pass(head_dim, partial):
    heads, kv_heads = 4, 2
    rope = tiny_rope(head_dim, partial)
    table: RotaryTable = rope.lookup(POSITIONS)
    t = len(POSITIONS)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim) * 2
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    q_w, k_w = 1.0 + 0.3 * torch.randn(head_dim), 1.0 + 0.3 * torch.randn(head_dim)
    got = triton_fused.qk_norm_rotary(table, q, k, q_w, k_w, EPS)
    ref = (rotate_torch(table, rms_norm_torch(q, q_w, EPS)),
           rotate_torch(table, rms_norm_torch(k, k_w, EPS)))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("model_cls,partial", [(TinyQwen3, 1.0), (TinyQwen3, 0.5),
                                               (DecoderForCausalLM, 1.0)])
def test_model_on_triton_kernels_equals_the_cpu_build(platform_listing, model_cls, partial):
    """A prefill then a decode step through every fused op: Triton-bound layers give the
    logits of CPU-bound ones (same weights, float32)."""
    from inference_engine.testing_parity import Seq, build_twin, randomize, run_step

    config = tiny_config(partial)
    twins = []
    for kernels in (["cpu", "torch"], ["triton", "torch"]):
        platform_listing(kernels)
        twins.append(build_twin(model_cls, config, None))
    cpu, tri = twins
    randomize(cpu.model)
    tri.model.load_state_dict(cpu.model.state_dict())
    for model in (cpu.model, tri.model):
        for layer in model.model.layers:
            layer.self_attn.process_weights_after_loading()
    assert tri.model.model.norm.fused_op == "triton" and cpu.model.model.norm.fused_op == "cpu"
    prompt = [3, 17, 42, 9, 100, 5, 77]
    for seq in (Seq(prompt, 0, [0, 1]), Seq(prompt + [11], 7, [0, 1])):
        torch.testing.assert_close(run_step(tri, [seq]), run_step(cpu, [seq]),
                                   atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- #
# On a GPU: compiled kernels, bf16 bit for bit
# --------------------------------------------------------------------------- #


def assert_bf16_nearly_equal(got: torch.Tensor, ref: torch.Tensor,
                             max_mismatch: float = 1e-2) -> None:
    """Equal but for a small fraction of elements, each one bf16 ulp away (same sign)."""
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    differs = got != ref
    assert differs.float().mean().item() <= max_mismatch
    ulps = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_kernels_on_gpu_follow_the_torch_rounding():
    """Compiled kernels in bf16: the residual sum bit for bit, the rest equal to torch's
    rounding order but for rare one-ulp differences of float32 intermediates."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    for width in (24, 80, 2048, 5120):
        x = (torch.randn(33, width, device=cuda) * 3).to(bf16)
        residual = torch.randn(33, width, device=cuda).to(bf16)
        weight = (1.0 + 0.3 * torch.randn(width, device=cuda)).to(bf16)
        got, got_sum = triton_fused.rms_norm(x, weight, EPS, residual)
        ref, ref_sum = rms_norm_torch(x, weight, EPS, residual)
        assert torch.equal(got_sum, ref_sum)
        assert_bf16_nearly_equal(got, ref)
        gate_up = (torch.randn(33, 2 * width, device=cuda) * 4).to(bf16)
        assert_bf16_nearly_equal(triton_fused.silu_and_mul(gate_up),
                                 silu_and_mul_torch(gate_up), 1e-3)
    rope = RotaryEmbedding(128, 4096, {"rope_type": "default", "rope_theta": 1e6,
                                       "partial_rotary_factor": 1.0}, bf16).to(cuda)
    table = rope.lookup(torch.arange(0, 4000, 97, device=cuda))
    x = torch.randn(len(table.rows), 12, 128, device=cuda).to(bf16)
    assert_bf16_nearly_equal(triton_fused.rotary(table, x), rotate_torch(table, x))
