"""The NVIDIA CUDA platform (not ROCm: that build reports torch.version.hip).

Capability families it distinguishes (``cuda_family()``):

========  ============================  =====================================
family    capability (examples)         what changes
========  ============================  =====================================
sm75      7.5 (T4, RTX 20xx)            fp16 only, no bf16 tensor cores
sm80      8.0, 8.6, 8.7 (A100, A10)     bf16; no FP8 math (FP8 weights dequantize)
sm89      8.9 (L4, RTX 4090)            FP8 E4M3 math: torch._scaled_mm, Triton fp8 dot
sm90      9.0 (H100, H200)              FP8 as sm89, large shared memory
sm100     10.x, 11.x (B200, GB200)      + FP4 (NVFP4/MXFP4 block-scaled)
sm120     12.x (RTX 5090, RTX PRO 6000) FP8 and FP4, but ~99 KiB shared memory
========  ============================  =====================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from inference_engine.interfaces.platform import (
    KERNEL_INT8_MM,
    KERNEL_SCALED_MM_FP4,
    KERNEL_SCALED_MM_FP8,
    KERNEL_TRITON_FP8,
    KERNEL_TRITON_FP8_BLOCK,
    KERNEL_TRITON_INT_WEIGHT_ONLY,
    KERNEL_TRITON_MXFP4,
    MemoryProfiler,
    Platform,
)
from inference_engine.platforms.device_info import (
    DeviceInfoSource,
    TorchCudaDeviceInfo,
    triton_has_backend,
)

__all__ = ["CudaPlatform", "TorchCudaMemoryProfiler", "TorchCudaRuntime", "capture_cuda_graph", "cuda_family",
           "cuda_sync_forbidden"]

MIN_CAPABILITY = (7, 5)


def cuda_family(capability: tuple[int, int]) -> str:
    """The capability family name (table above); ``"sm70"`` and older are reported as is."""
    major, minor = capability
    if capability < MIN_CAPABILITY:
        return f"sm{major}{minor}"
    if major == 7:
        return "sm75"
    if capability < (8, 9):
        return "sm80"
    if major == 8:
        return "sm89"
    if major == 9:
        return "sm90"
    if major in (10, 11):
        return "sm100"
    return "sm120"


class TorchCudaMemoryProfiler(MemoryProfiler):
    """``torch.cuda``'s allocator statistics for one device (NVIDIA and ROCm builds)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def capture_cuda_graph(fn: Callable[[], Any], pool: Any = None) -> tuple[Any, Any, Any]:
    """``fn`` captured in a ``torch.cuda.CUDAGraph`` (HIP graphs on ROCm builds)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output, graph.pool()


@contextmanager
def cuda_sync_forbidden() -> Iterator[None]:
    """torch's sync debug mode set to raise on a host synchronisation, restored after."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class TorchCudaRuntime(Platform):
    """What every platform on ``torch.cuda``'s runtime shares (NVIDIA CUDA, AMD ROCm/HIP):
    streams run asynchronously to the host, graphs, events, allocator statistics."""

    def supports_graph_capture(self) -> bool:
        return not self.info.simulated

    def supports_async_scheduling(self) -> bool:
        return not self.info.simulated

    def distributed_backend(self) -> str:
        # RCCL under the same name on ROCm. NCCL needs the rank's device current before
        # its first collective: the engine calls set_up_process first.
        return "nccl"

    def set_up_process(self) -> None:
        if not self.info.simulated:
            torch.cuda.set_device(self.device())

    def ray_actor_resources(self) -> dict[str, float]:
        return {"num_cpus": 0, "num_gpus": 1}

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device())

    def default_max_num_seqs(self) -> int:
        return 256

    def memory_profiler(self) -> MemoryProfiler | None:
        return None if self.info.simulated else TorchCudaMemoryProfiler(self.device())

    def capture_graph(self, fn: Callable[[], Any], pool: Any = None) -> tuple[Any, Any, Any]:
        return capture_cuda_graph(fn, pool)

    def forbid_host_sync(self) -> AbstractContextManager[None]:
        return cuda_sync_forbidden()

    def record_event(self) -> Any:
        event = torch.cuda.Event()
        event.record()
        return event


class CudaPlatform(TorchCudaRuntime):
    name = "cuda"
    device_type = "cuda"
    priority = 10
    device_info_kind = "cuda"
    visible_devices_env_vars = ("CUDA_VISIBLE_DEVICES",)

    @classmethod
    def make_device_info(cls) -> DeviceInfoSource:
        return TorchCudaDeviceInfo(hip=False)

    @classmethod
    def absence_reason(cls) -> str:
        if cls.device_info().simulated:
            return "the simulated machine has no NVIDIA GPU"
        if torch.version.hip is not None:
            return f"torch {torch.__version__} is a ROCm build; use --platform rocm"
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        return "torch.cuda.is_available() is False (no GPU or no driver)"

    def capability(self) -> tuple[int, int]:
        cap = self.properties().capability
        if cap is None:
            raise RuntimeError(f"device {self.device_ids[0]} reports no compute capability")
        return cap

    def cuda_family(self) -> str:
        return cuda_family(self.capability())

    def arch_name(self) -> str:
        major, minor = self.capability()
        return f"sm{major}{minor}"

    def supported_dtypes(self) -> list[torch.dtype]:
        if self.capability() >= (8, 0):
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def fp8_dtype(self) -> torch.dtype | None:
        return torch.float8_e4m3fn if self.capability() >= (8, 9) else None

    def supports_fp4(self) -> bool:
        return self.capability()[0] >= 10

    def supports_triton(self) -> bool:
        return self.capability() >= MIN_CAPABILITY and triton_has_backend("nvidia")

    def fp8_gemm_kernels(self) -> list[str]:
        if self.fp8_dtype() is None:
            return []
        kernels = [KERNEL_SCALED_MM_FP8]
        if self.supports_triton():
            kernels += [KERNEL_TRITON_FP8, KERNEL_TRITON_FP8_BLOCK]
        return kernels

    def int_gemm_kernels(self) -> list[str]:
        kernels = [KERNEL_INT8_MM] if self.capability() >= (8, 0) else []
        if self.supports_triton():
            kernels.append(KERNEL_TRITON_INT_WEIGHT_ONLY)
        return kernels

    def fp4_gemm_kernels(self) -> list[str]:
        if not self.supports_fp4():
            return []
        kernels = [KERNEL_SCALED_MM_FP4]
        if self.supports_triton():
            kernels.append(KERNEL_TRITON_MXFP4)
        return kernels

    def describe(self) -> dict:
        described = super().describe()
        described["cuda_family"] = self.cuda_family()
        described["shared_memory_per_block"] = self.properties().shared_memory_per_block
        return described
