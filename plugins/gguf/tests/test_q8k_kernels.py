"""K-quant x Q8_K (llama.cpp's CPU arithmetic) against a numpy statement of ggml's reference C.

:func:`quantize_q8_k_numpy` transcribes ggml's ``quantize_row_q8_K_ref`` (first value of
largest magnitude, ``iscale = -127/max``, ``nearest_int`` through the float mantissa,
``min(127, .)``); weights are dequantized by the ``gguf`` package. The matmul reference is
those rounded activations times those weights in float64: what llama.cpp's integer sums equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType
from inference_engine.cpu_extensions import cpu_isa_flags
from inference_engine.cpu_thread_pool import kernel_runner, thread_pool
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.quant_method import tiled_linear
from inference_engine_gguf.testing import (
    cpu_has_avx2,
    q8k_matmul_reference,
    q80_matmul_reference,
    quantize_q8_0_numpy,
    quantize_q8_k_numpy,
    random_ggml_rows,
)

T = GGMLQuantizationType
K_QUANTS = sorted(q8k_kernels.Q8K_TYPES)



CPU_FLAGS = set(cpu_isa_flags())
HAS_AVX2 = cpu_has_avx2()


def test_kernel_builds_and_tiles_exist_where_the_cpu_has_avx2_or_vnni():
    """The tests below skip without the kernel: a failed build must fail here instead."""
    assert q8k_kernels.kernel() is not None, "the Q8_K kernel failed to build (see the log)"
    if HAS_AVX2 or {"avx512bw", "avx512_vnni"} <= CPU_FLAGS:
        assert q8k_kernels.packing_available()


def rows_of(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_ggml_rows(qtype, rows, blocks_per_row, seed))


requires_kernel = pytest.mark.skipif(
    q8k_kernels.kernel() is None, reason="the C++ Q8_K kernel could not be built here")


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0.0  # an all-zero block: d = 0
    if m > 1:
        x[1, 3], x[1, 7] = 4.0, -4.0  # equal magnitudes: the first one sets the sign of d
    return x


def assert_close(ours: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Exact integer sums, a few float32 roundings per 256-value block: well within 2^-20."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    excess = ((ours.double() - ref).abs() / (magnitude * 2**-20 + 1e-30)).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the bound"


@requires_kernel
def test_quantization_equals_ggml_reference_bit_for_bit():
    x = activations(5, 768, seed=0) * 3.0
    x[2, 300:400] = 1e-30  # tiny values in a block whose max is large
    qs_ref, d_ref = quantize_q8_k_numpy(x.numpy())
    bsums_ref = qs_ref.reshape(5, -1, 16).astype(np.int32).sum(-1).astype(np.int16)
    for qs, d, bsums in (q8k_kernels.quantize_q8_k(x), q8k_kernels.kernel().quantize_q8k(x)):
        assert np.array_equal(qs.numpy(), qs_ref)
        assert np.array_equal(d.numpy().view(np.uint32), d_ref.view(np.uint32))
        assert np.array_equal(bsums.numpy(), bsums_ref)
    assert d_ref[0, 0] == 0 and d_ref[1, 0] < 0  # the zero block; the first peak is +4.0


@requires_kernel
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 16])
def test_matmul_matches_q8k_matmul_reference(qtype, m):
    # N = 37: not a multiple of the kernel's 8 weight rows per task; 3 blocks per row.
    raw = rows_of(qtype, rows=37, blocks_per_row=3, seed=int(qtype) + m)
    x = activations(m, 768, seed=m)
    ref, magnitude = q8k_matmul_reference(x, raw, qtype)
    assert_close(q8k_kernels.q8k_linear(x, raw, qtype), ref, magnitude)
    # The torch fallback is the same arithmetic.
    assert_close(q8k_kernels.q8k_linear_reference(x, raw, qtype), ref, magnitude)


@requires_kernel
def test_quantized_blocks_from_gguf_and_leading_dims():
    """Blocks quantized by llama.cpp's formula (not random bytes), activations [2, 3, K]."""
    rng = np.random.default_rng(0)
    for qtype in (T.Q4_K, T.Q6_K):
        values = rng.standard_normal((24, 512)).astype(np.float32)
        try:
            raw = torch.from_numpy(quants.quantize(values, qtype))
        except NotImplementedError:
            raw = rows_of(qtype, rows=24, blocks_per_row=2, seed=5)
        x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(1))
        ref, magnitude = q8k_matmul_reference(x.reshape(6, 512), raw, qtype)
        ours = q8k_kernels.q8k_linear(x, raw, qtype)
        assert ours.shape == (2, 3, 24)
        assert_close(ours.reshape(6, 24), ref, magnitude)


@requires_kernel
def test_parts_write_their_columns():
    x = activations(4, 512, seed=3)
    raws = [rows_of(T.Q4_K, rows=20, blocks_per_row=2, seed=1),
            rows_of(T.Q6_K, rows=9, blocks_per_row=2, seed=2)]
    parts = q8k_kernels.Q8Parts(raws, [int(T.Q4_K), int(T.Q6_K)], [False, False])
    out = torch.full((4, 29), float("nan"))
    q8k_kernels.q8k_parts_linear(x, parts, out)
    for cols, raw, qtype in ((slice(0, 20), raws[0], T.Q4_K), (slice(20, 29), raws[1], T.Q6_K)):
        ref, magnitude = q8k_matmul_reference(x, raw, qtype)
        assert_close(out[:, cols], ref, magnitude)
    # A part of another activation type in the same call is refused, not miscomputed.
    mixed = q8k_kernels.Q8Parts([raws[0], rows_of(T.Q8_0, rows=9, blocks_per_row=16, seed=4)],
                                [int(T.Q4_K), int(T.Q8_0)], [False, False])
    with pytest.raises(RuntimeError, match="different activation roundings"):
        q8k_kernels.q8k_parts_linear(x, mixed, torch.empty(4, 29))


@requires_kernel
def test_tiled_linear_routes_by_activation_mode():
    raw = rows_of(T.Q4_K, rows=12, blocks_per_row=2, seed=7)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    q8 = tiled_linear(x, raw, T.Q4_K, activations="q8")
    exact = tiled_linear(x, raw, T.Q4_K, activations="float")
    assert torch.equal(q8, q8k_kernels.q8k_linear(x, raw, T.Q4_K))
    ref, magnitude = q8k_matmul_reference(x, raw, T.Q4_K)
    assert_close(q8, ref, magnitude)
    # The float path is the exact product: Q8_K rounding is visible against it.
    assert (q8 - exact).abs().max() > 1e3 * (q8.double() - ref).abs().max()


@requires_kernel
def test_pool_and_aten_threads_give_identical_results():
    if thread_pool() is None:
        pytest.skip("the CPU kernels' thread pool is not available here")
    raw = rows_of(T.Q6_K, rows=50, blocks_per_row=2, seed=9)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(4))
    ext = q8k_kernels.kernel()
    results = []
    for use_pool in (True, False):
        with kernel_runner(ext, use_pool):
            results.append(q8k_kernels.q8k_linear(x, raw, T.Q6_K))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("qtype", sorted(q8k_kernels.PACKED_TYPES), ids=lambda t: t.name)
def test_tiles_are_a_permutation_of_the_raw_rows(qtype):
    raw = rows_of(qtype, rows=48, blocks_per_row=3, seed=11)
    tiles = q8k_kernels.pack_tiles(raw, qtype)
    assert tiles.shape == (3, raw.shape[1] * 16) and tiles.dtype == torch.uint8
    assert torch.equal(tiles.flatten().sort().values, raw.flatten().sort().values)
    assert torch.equal(q8k_kernels.unpack_tiles(tiles, qtype), raw)
    with pytest.raises(ValueError, match="multiples of 16"):
        q8k_kernels.pack_tiles(raw[:40], qtype)


@pytest.mark.skipif(not q8k_kernels.packing_available(), reason="needs AVX2 or AVX512-BW + VNNI")
@pytest.mark.parametrize("qtype", sorted(q8k_kernels.PACKED_TYPES & q8k_kernels.Q8K_TYPES),
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 9, 16, 21])
def test_packed_tiles_match_reference(qtype, m):
    """Every row-group size of the kernel (8 / 4 / 1 activation rows per pass) and
    several tiles (the prefetch of a later tile)."""
    raw = rows_of(qtype, rows=112, blocks_per_row=2, seed=int(qtype) * m)
    x = activations(m, 512, seed=m + 1)
    out = torch.full((m, 120), float("nan"))
    other = rows_of(T.Q5_K, 8, 2, seed=3)
    parts = q8k_kernels.Q8Parts([q8k_kernels.pack_tiles(raw, qtype), other],
                                [int(qtype), int(T.Q5_K)], [True, False])
    q8k_kernels.q8k_parts_linear(x, parts, out)
    ref, magnitude = q8k_matmul_reference(x, raw, qtype)
    assert_close(out[:, :112], ref, magnitude)
    assert torch.equal(out[:, 112:], q8k_kernels.q8k_linear(x, other, T.Q5_K))


@pytest.fixture(scope="module")
def portable_kernel():
    """The same source built without AVX2 and AVX-512: the loops machines without them run."""
    from inference_engine.cpu_thread_pool import load_pooled_build
    from inference_engine_gguf.testing import PORTABLE_Q8K_BUILD

    ext = load_pooled_build(PORTABLE_Q8K_BUILD)
    if ext is None:
        pytest.skip("the kernel could not be built without AVX2 here")
    return ext


@pytest.fixture(scope="module")
def avx2_kernel():
    """The same source built for AVX2 only (on an AVX-512 CPU too): the AVX2 tile kernels."""
    from inference_engine.cpu_thread_pool import load_pooled_build
    from inference_engine_gguf.testing import AVX2_Q8K_BUILD

    if not HAS_AVX2:
        pytest.skip("the CPU has no AVX2 + FMA + F16C")
    ext = load_pooled_build(AVX2_Q8K_BUILD)
    if ext is None:
        pytest.skip("the kernel could not be built for AVX2 here")
    return ext


@requires_kernel
@pytest.mark.parametrize("qtype", sorted(q8k_kernels.PACKED_TYPES), ids=lambda t: t.name)
def test_avx2_tiles_match_reference(avx2_kernel, qtype):
    """The AVX2 form of every packed tile type (two registers per 16 lanes, vpmaddubsw +
    vpmaddwd products) against the reference, 1, 4, 5 and 9 activation rows."""
    assert avx2_kernel.packed_available()
    raw = rows_of(qtype, rows=48, blocks_per_row=2 if qtype in q8k_kernels.Q8K_TYPES else 16,
                  seed=int(qtype))
    reference = (q8k_matmul_reference if qtype in q8k_kernels.Q8K_TYPES
                 else q80_matmul_reference)
    tiles = q8k_kernels.pack_tiles(raw, qtype)
    for m in (1, 4, 5, 9):
        x = activations(m, 512, seed=m) * 2.0
        out = torch.full((m, 48), float("nan"))
        avx2_kernel.q8k_parts_into(x, [tiles], [int(qtype)], [True], out)
        ref, magnitude = reference(x, raw, qtype)
        assert_close(out, ref, magnitude)


@requires_kernel
def test_build_without_avx512_matches_reference(portable_kernel):
    assert not portable_kernel.packed_available()
    x = activations(5, 768, seed=7) * 2.0
    qs_ref, d_ref = quantize_q8_k_numpy(x.numpy())
    qs, d, _ = portable_kernel.quantize_q8k(x)
    assert np.array_equal(qs.numpy(), qs_ref)
    assert np.array_equal(d.numpy().view(np.uint32), d_ref.view(np.uint32))
    for qtype in K_QUANTS:
        raw = rows_of(qtype, rows=13, blocks_per_row=3, seed=int(qtype))
        ref, magnitude = q8k_matmul_reference(x, raw, qtype)
        assert_close(portable_kernel.ggml_linear_q8k(x, raw, int(qtype)), ref, magnitude)


@pytest.mark.skipif(not q8k_kernels.packing_available(), reason="needs AVX2 or AVX512-BW + VNNI")
def test_q8_0_activations_equal_llamacpp_rounding_bit_for_bit():
    x = activations(5, 512, seed=12) * 4.0
    x[2, 64:96] = 0.0  # a zero block
    x[3, 100] = 1e-30
    qs, d, sums = q8k_kernels.kernel().quantize_q8_0(x)
    qs_ref, d_ref = quantize_q8_0_numpy(x.numpy())
    assert np.array_equal(qs.numpy(), qs_ref)
    assert np.array_equal(d.numpy().view(np.uint32), d_ref.view(np.uint32))
    assert np.array_equal(sums.numpy(), qs_ref.reshape(5, -1, 32).astype(np.int32).sum(-1))


@pytest.mark.skipif(not q8k_kernels.packing_available(), reason="needs AVX2 or AVX512-BW + VNNI")
@pytest.mark.parametrize("qtype", sorted(q8k_kernels.PACKED_TYPES & q8k_kernels.Q80_TYPES),
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 4, 9, 16])
def test_q8_0_tiles_match_reference(qtype, m):
    """Q8_0 / Q4_0 tiles against Q8_0 activations, several tiles, two parts in one call."""
    raws = [rows_of(qtype, rows=48, blocks_per_row=16, seed=m), rows_of(qtype, 32, 16, seed=9)]
    parts = q8k_kernels.Q8Parts([q8k_kernels.pack_tiles(r, qtype) for r in raws],
                                [int(qtype)] * 2, [True, True])
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    out = torch.full((m, 80), float("nan"))
    q8k_kernels.q8k_parts_linear(x, parts, out)
    for cols, raw in ((slice(0, 48), raws[0]), (slice(48, 80), raws[1])):
        ref, magnitude = q80_matmul_reference(x, raw, qtype)
        assert_close(out[:, cols], ref, magnitude)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_weights_round_activations_to_their_type_in_q8_mode(qtype):
    """llama.cpp's F16 / BF16 matmuls convert the activations to that type (vec_dot_type)."""
    half = torch.float16 if qtype == T.F16 else torch.bfloat16
    w = (torch.randn(24, 256, generator=torch.Generator().manual_seed(3)) * 0.1).to(half)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    ref = x.to(half).double() @ w.double().t()
    q8 = tiled_linear(x, w, qtype, activations="q8")
    exact = tiled_linear(x, w, qtype, activations="float")
    magnitude = x.to(half).double().abs() @ w.double().abs().t()
    assert ((q8.double() - ref).abs() <= magnitude * 2**-20).all()
    assert (exact.double() - ref).abs().max() > 100 * (q8.double() - ref).abs().max()
