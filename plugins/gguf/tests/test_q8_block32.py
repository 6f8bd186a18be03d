"""32-value block types x Q8_0 / Q8_1 activations (llama.cpp's CPU arithmetic) against a numpy
transcription of ggml's code.

The references (:mod:`inference_engine_gguf.testing`): ``quantize_q8_0_numpy`` /
``quantize_q8_1_numpy`` transcribe llama.cpp's x86 ``quantize_row_q8_0`` / ``_q8_1`` (fp16 ``d =
max/127``, half-to-even quants, Q8_1's ``s = fp16(d * sum)``); ``block32_quants_numpy`` reads
the weight blocks as ggml's structs do (checked here against the ``gguf`` package's
dequantization); ``block32_matmul_reference`` sums ``d_w d_a sum(q_w q_a) + m_w s_a`` per block
in float64, as ``ggml_vec_dot_*_q8_*`` does exactly up to float32 summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.quant_method import tiled_linear
from inference_engine_gguf.testing import (
    block32_matmul_reference,
    block32_quants_numpy,
    iq4_xs_matmul_reference,
    quantize_q8_0_numpy,
    quantize_q8_1_numpy,
    random_ggml_rows,
)

T = GGMLQuantizationType
BLOCK32_TYPES = sorted(q8k_kernels.Q80_TYPES | q8k_kernels.Q81_TYPES)

requires_kernel = pytest.mark.skipif(
    q8k_kernels.kernel() is None, reason="the C++ Q8_K kernel could not be built here")


def rows_of(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> torch.Tensor:
    raw = random_ggml_rows(qtype, rows, blocks_per_row, seed)
    if qtype == getattr(T, "MXFP4", None):  # scales 2^-10..2^-1, as real weights have
        blocks = raw.reshape(rows, blocks_per_row, -1)
        blocks[..., 0] = np.random.default_rng(seed).integers(118, 128, blocks.shape[:2])
    return torch.from_numpy(raw)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2.0
    x[0, :32] = 0.0  # an all-zero block: d = s = 0
    if m > 1:
        x[1, 40] = 1e-30  # a tiny value in a block whose max is large
    return x


def assert_close(ours: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """Exact integer block sums, a few float32 roundings per 32-value block."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    excess = ((ours.double() - ref).abs() / (bound * 2**-20 + 1e-30)).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the bound"


@pytest.mark.parametrize("qtype", BLOCK32_TYPES, ids=lambda t: t.name)
def test_block_reading_equals_gguf_dequantization(qtype):
    """The reference's reading of the blocks is ggml's: d * q + m is gguf's value, bit for bit."""
    raw = random_ggml_rows(qtype, rows=7, blocks_per_row=3, seed=int(qtype))
    q, d, m = block32_quants_numpy(raw, qtype)
    values = (np.repeat(d, 32, axis=1) * q.astype(np.float32)).astype(np.float32)
    if qtype in q8k_kernels.Q81_TYPES:  # (adding a zero min would turn -0.0 into +0.0)
        values = (values + np.repeat(m, 32, axis=1)).astype(np.float32)
    else:
        assert not m.any()
    expected = quants.dequantize(raw, qtype)
    assert np.array_equal(values.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@requires_kernel
def test_q8_1_activations_equal_llamacpp_rounding_bit_for_bit():
    x = activations(5, 512, seed=3)
    x[3, 100:132] = -1e-3  # a block of equal values: the sum times d
    qs, d, s = q8k_kernels.kernel().quantize_q8_1(x)
    qs_ref, d_ref, s_ref = quantize_q8_1_numpy(x.numpy())
    assert np.array_equal(qs.numpy(), qs_ref)
    assert np.array_equal(d.numpy().view(np.uint32), d_ref.view(np.uint32))
    assert np.array_equal(s.numpy().view(np.uint32), s_ref.view(np.uint32))
    assert s_ref[0, 0] == 0 and d_ref[0, 0] == 0
    # The Q8_0 half is llama.cpp's quantize_row_q8_0.
    qs0, d0 = quantize_q8_0_numpy(x.numpy())
    assert np.array_equal(qs_ref, qs0) and np.array_equal(d_ref, d0)


@requires_kernel
@pytest.mark.parametrize("qtype", BLOCK32_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_raw_rows_match_reference(qtype, m):
    # N = 37: not a multiple of the kernel's 8 weight rows per task; 12 blocks per row.
    raw = rows_of(qtype, rows=37, blocks_per_row=12, seed=int(qtype) * 7 + m)
    x = activations(m, 384, seed=m)
    ref, bound = block32_matmul_reference(x, raw, qtype)
    assert_close(q8k_kernels.q8_linear(x, raw, qtype), ref, bound)


@requires_kernel
def test_gguf_quantized_blocks_and_leading_dims():
    """Blocks quantized by llama.cpp's formulas (the gguf package), activations [2, 3, K]."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((24, 256)).astype(np.float32)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    for qtype in (T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_0):
        raw = torch.from_numpy(quants.quantize(values, qtype))
        ref, bound = block32_matmul_reference(x.reshape(6, 256), raw, qtype)
        ours = q8k_kernels.q8_linear(x, raw, qtype)
        assert ours.shape == (2, 3, 24)
        assert_close(ours.reshape(6, 24), ref, bound)


@requires_kernel
def test_parts_of_one_rounding_share_a_call_and_mixed_ones_are_refused():
    x = activations(3, 256, seed=5)
    raws = [rows_of(T.Q4_1, 20, 8, seed=1), rows_of(T.Q5_1, 9, 8, seed=2)]
    parts = q8k_kernels.Q8Parts(raws, [int(T.Q4_1), int(T.Q5_1)], [False, False])
    out = torch.full((3, 29), float("nan"))
    q8k_kernels.q8k_parts_linear(x, parts, out)
    for cols, raw, qtype in ((slice(0, 20), raws[0], T.Q4_1), (slice(20, 29), raws[1], T.Q5_1)):
        ref, bound = block32_matmul_reference(x, raw, qtype)
        assert_close(out[:, cols], ref, bound)
    mixed = q8k_kernels.Q8Parts([raws[0], rows_of(T.Q5_0, 9, 8, seed=3)],
                                [int(T.Q4_1), int(T.Q5_0)], [False, False])
    with pytest.raises(RuntimeError, match="different activation roundings"):
        q8k_kernels.q8k_parts_linear(x, mixed, torch.empty(3, 29))
    with pytest.raises(RuntimeError, match="no 8-bit activation dot product"):
        q8k_kernels.q8k_parts_linear(x, q8k_kernels.Q8Parts([raws[0]], [int(T.F16)], [False]),
                                     torch.empty(3, 20))


@pytest.mark.skipif(not q8k_kernels.packing_available(), reason="needs AVX2 or AVX512-BW + VNNI")
def test_packed_q8_0_beside_raw_q5_0_in_one_call():
    """Both take Q8_0 activations: one quantization, each part its own kernel."""
    x = activations(4, 512, seed=8)
    q8 = rows_of(T.Q8_0, 32, 16, seed=4)
    q5 = rows_of(T.Q5_0, 11, 16, seed=5)
    parts = q8k_kernels.Q8Parts([q8k_kernels.pack_tiles(q8, T.Q8_0), q5],
                                [int(T.Q8_0), int(T.Q5_0)], [True, False])
    out = torch.full((4, 43), float("nan"))
    q8k_kernels.q8k_parts_linear(x, parts, out)
    for cols, raw, qtype in ((slice(0, 32), q8, T.Q8_0), (slice(32, 43), q5, T.Q5_0)):
        ref, bound = block32_matmul_reference(x, raw, qtype)
        assert_close(out[:, cols], ref, bound)


@requires_kernel
def test_tiled_linear_rounds_block32_activations_in_q8_mode_only():
    raw = rows_of(T.Q4_1, 12, 8, seed=7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    q8 = tiled_linear(x, raw, T.Q4_1, activations="q8")
    exact = tiled_linear(x, raw, T.Q4_1, activations="float")
    ref, bound = block32_matmul_reference(x, raw, T.Q4_1)
    assert_close(q8, ref, bound)
    assert (q8 - exact).abs().max() > 1e3 * (q8.double() - ref).abs().max()


@pytest.fixture(scope="module")
def scalar_kernel():
    """The same source built without AVX2 / AVX-512: the scalar loops other CPUs run."""
    from inference_engine.cpu_thread_pool import load_pooled_build
    from inference_engine_gguf.testing import PORTABLE_Q8K_BUILD

    ext = load_pooled_build(PORTABLE_Q8K_BUILD)
    if ext is None:
        pytest.skip("the kernel could not be built without AVX2 here")
    return ext


@requires_kernel
def test_scalar_build_matches_reference(scalar_kernel):
    x = activations(3, 256, seed=9)
    qs_ref, d_ref, s_ref = quantize_q8_1_numpy(x.numpy())
    qs, d, s = scalar_kernel.quantize_q8_1(x)
    assert np.array_equal(qs.numpy(), qs_ref) and np.array_equal(s.numpy(), s_ref)
    for qtype in BLOCK32_TYPES:
        raw = rows_of(qtype, 13, 8, seed=int(qtype))
        out = torch.empty(3, 13)
        scalar_kernel.q8k_parts_into(x, [raw], [int(qtype)], [False], out)
        ref, bound = block32_matmul_reference(x, raw, qtype)
        assert_close(out, ref, bound)
    raw = rows_of(T.IQ4_XS, 13, 1, seed=2)
    out = torch.empty(3, 13)
    scalar_kernel.q8k_parts_into(x, [raw], [int(T.IQ4_XS)], [False], out)
    ref, bound = iq4_xs_matmul_reference(x, raw)
    assert_close(out, ref, bound)


@requires_kernel
@pytest.mark.parametrize("m", [1, 3, 16])
def test_iq4_xs_rows_match_reference(m):
    """IQ4_XS against Q8_K activations (ggml_vec_dot_iq4_xs_q8_K), beside a Q4_K part."""
    raw = rows_of(T.IQ4_XS, rows=21, blocks_per_row=2, seed=m)
    x = activations(m, 512, seed=m + 3)
    ref, bound = iq4_xs_matmul_reference(x, raw)
    assert_close(q8k_kernels.q8_linear(x, raw, T.IQ4_XS), ref, bound)
    q4k = rows_of(T.Q4_K, rows=8, blocks_per_row=2, seed=m)
    parts = q8k_kernels.Q8Parts([raw, q4k], [int(T.IQ4_XS), int(T.Q4_K)], [False, False])
    out = torch.full((m, 29), float("nan"))
    q8k_kernels.q8k_parts_linear(x, parts, out)
    assert_close(out[:, :21], ref, bound)
    assert torch.equal(out[:, 21:], q8k_kernels.q8k_linear(x, q4k, T.Q4_K))


def test_iq4_xs_reference_reads_blocks_as_gguf():
    """The reference's reading of IQ4_XS blocks gives gguf's values: Q8_K activations of one
    nonzero value pick out single weights, d_w * ls * q exactly."""
    raw = rows_of(T.IQ4_XS, rows=3, blocks_per_row=1, seed=5)
    dense = quants.dequantize(raw.numpy(), T.IQ4_XS).astype(np.float64)
    for j in (0, 17, 40, 255):
        x = torch.zeros(1, 256)
        x[0, j] = 1.0  # Q8_K: d = -1/127, quant -127: exactly -1 * -1
        ref, _ = iq4_xs_matmul_reference(x, raw)
        assert np.allclose(ref[0].numpy(), dense[:, j], rtol=1e-6, atol=0)
