"""The C++ GGML block kernel against the torch reference (dequant.py + torch matmul)."""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from inference_engine import cpu_extensions
from inference_engine.cpu_extensions import CSRC_DIR as CORE_CSRC_DIR
from inference_engine_gguf import cpu_kernels, quant_method
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.quant_method import GGMLEmbedding, tiled_linear
from inference_engine_gguf.testing import random_ggml_rows

T = GGMLQuantizationType
KERNEL_TYPES = sorted(cpu_kernels.KERNEL_TYPES)

requires_kernel = pytest.mark.skipif(
    cpu_kernels.kernel() is None, reason="the C++ GGML kernel could not be built here")


def make_raw(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int,
             seed: int) -> torch.Tensor:
    """Random GGML rows ``uint8 [rows, row_bytes]``: random bytes, finite float16 scales."""
    return torch.from_numpy(random_ggml_rows(qtype, rows, blocks_per_row, seed))


def assert_close_to_reference(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 accumulation error of ``x @ w.T`` (computed in float64)."""
    ref = (x.double() @ w.double().T)
    bound = (x.double().abs() @ w.double().abs().T) * (x.shape[-1] * 2**-23) + 1e-30
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    excess = ((ours.double() - ref).abs() / bound).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the float32 accumulation bound"


@requires_kernel
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 16, 37])
def test_linear_matches_torch_reference(qtype, m):
    block_size = GGML_QUANT_SIZES[qtype][0]
    # N = 37 is not a multiple of the 4-row micro tile nor of the kernel's row tile;
    # 3 blocks per row make K = 96 or 768.
    raw = make_raw(qtype, rows=37, blocks_per_row=3, seed=int(qtype) + m)
    w = dequantize(raw, qtype)
    x = torch.randn(m, 3 * block_size, generator=torch.Generator().manual_seed(m))
    ours = cpu_kernels.ggml_linear(x, raw, qtype)
    assert_close_to_reference(ours, x, w)
    torch.testing.assert_close(ours, x @ w.T, rtol=1e-5, atol=1e-5 * w.abs().max().item())


@requires_kernel
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_linear_many_rows_and_long_rows(qtype):
    """Many output rows (several row tiles per thread), K = 4096 (a tile of 4 rows),
    and M past DENSE_MIN_ROWS (the dequantize + GEMM path)."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    raw = make_raw(qtype, rows=203, blocks_per_row=4096 // block_size, seed=7)
    w = dequantize(raw, qtype)
    gen = torch.Generator().manual_seed(0)
    for m in (5, cpu_kernels.DENSE_MIN_ROWS + 3):
        x = torch.randn(m, 4096, generator=gen)
        assert_close_to_reference(cpu_kernels.ggml_linear(x, raw, qtype), x, w)


@requires_kernel
def test_linear_takes_strided_and_batched_activations():
    raw = make_raw(T.Q4_K, rows=9, blocks_per_row=2, seed=3)
    w = dequantize(raw, T.Q4_K)
    x = torch.randn(2, 3, 1024)[..., :512]  # rows strided, last dim contiguous
    ours = cpu_kernels.ggml_linear(x, raw, T.Q4_K)
    assert ours.shape == (2, 3, 9)
    assert_close_to_reference(ours.reshape(6, 9), x.reshape(6, 512), w)


@requires_kernel
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact(qtype):
    raw = make_raw(qtype, rows=11, blocks_per_row=2, seed=int(qtype))
    ref = dequantize(raw, qtype)
    assert torch.equal(cpu_kernels.dequantize(raw, qtype).view(torch.int32), ref.view(torch.int32))
    ids = torch.tensor([10, 0, 4, 4])
    rows = cpu_kernels.dequantize_rows(raw, ids, qtype)
    assert torch.equal(rows.view(torch.int32), ref[ids].view(torch.int32))


@requires_kernel
def test_dequantize_rows_rejects_out_of_range_ids():
    raw = make_raw(T.Q8_0, rows=4, blocks_per_row=1, seed=0)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.dequantize_rows(raw, torch.tensor([4]), T.Q8_0)


@requires_kernel
def test_tiled_linear_uses_the_kernel_for_float32_on_cpu(monkeypatch):
    raw = make_raw(T.Q4_K, rows=5, blocks_per_row=1, seed=1)
    x = torch.randn(2, 256)
    calls = []
    real = cpu_kernels.ggml_linear
    monkeypatch.setattr(cpu_kernels, "ggml_linear", lambda *a: calls.append(1) or real(*a))
    tiled_linear(x, raw, T.Q4_K)
    assert calls == [1]
    tiled_linear(x.to(torch.bfloat16), raw, T.Q4_K)  # not float32: the torch path
    assert calls == [1]


def test_torch_path_when_kernels_are_disabled(monkeypatch):
    """With INFERENCE_ENGINE_CPU_KERNELS=0 the kernel is None and every caller uses torch."""
    monkeypatch.setenv(cpu_extensions.CPU_KERNELS_ENV, "0")
    monkeypatch.setattr(cpu_extensions, "_MODULES", {})
    assert cpu_kernels.kernel() is None
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.ggml_linear(torch.zeros(1, 256), make_raw(T.Q4_K, 1, 1, 0), T.Q4_K)
    monkeypatch.setattr(quant_method, "dequantize",
                        _counting(quant_method.dequantize, calls := []))
    raw = make_raw(T.Q6_K, rows=6, blocks_per_row=1, seed=2)
    x = torch.randn(3, 256)
    y = tiled_linear(x, raw, T.Q6_K)
    assert calls, "the torch dequantization was not used"
    torch.testing.assert_close(y, x @ dequantize(raw, T.Q6_K).T)
    embed = GGMLEmbedding(raw, T.Q6_K, torch.float32)
    out = embed(torch.tensor([5, 1]))
    assert torch.equal(out, dequantize(raw, T.Q6_K)[[5, 1]])


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapped


def test_kernel_builds():
    """The tests above skip without the kernel: a failed build must fail here instead."""
    assert cpu_kernels.kernel() is not None, "the GGML block kernel failed to build (see the log)"


@requires_kernel
def test_extension_is_built_under_its_content_hash():
    name = cpu_kernels.ggml_extension_name("inference_engine_gguf_ggml_matmul",
                                           cpu_kernels._SOURCES)
    assert cpu_kernels.kernel().__name__ == name


def test_extension_name_changes_when_a_header_changes(tmp_path):
    """Every source and header reached by ``#include "..."`` (the plugin's and the core's)
    is in the name's hash, so an edit rebuilds without a hand-bumped suffix."""
    shutil.copytree(cpu_kernels.CSRC_DIR, tmp_path, dirs_exist_ok=True)
    sources = [tmp_path / "ggml_matmul.cpp"]

    def name(**kwargs) -> str:
        return cpu_kernels.ggml_extension_name("stem", sources, **kwargs)

    before = name()
    assert name() == before
    header = tmp_path / "ggml_helpers.h"
    header.write_text(header.read_text() + "// edited\n")
    after_plugin_header = name()
    assert after_plugin_header != before
    # A copy of the core's header beside the source is found first: another file (paths are
    # hashed too, so copies of a tree build apart), and its content counts.
    core_header = tmp_path / "ie_parallel_tasks.h"
    core_header.write_text((CORE_CSRC_DIR / "ie_parallel_tasks.h").read_text())
    with_copy = name()
    assert with_copy != after_plugin_header
    core_header.write_text(core_header.read_text() + "// edited\n")
    assert name() not in (with_copy, after_plugin_header)
    # Each flag variant and each instruction set is its own build.
    assert name(extra_cflags=("-DQ8K_TEST=1",)) != name()
    assert name(flags=("avx2", "fma")) != name(flags=("avx2", "fma", "avx512f"))
    assert name(flags=("avx2", "fma")) == name(flags=("fma", "avx2", "hypervisor"))
