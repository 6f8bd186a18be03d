"""What a device can do; everything reads device facts through a Platform.

A platform answers questions (``fp8_dtype()``, ``supports_fp4()``,
``attention_backends()``); callers never branch on its name or class. Its
device facts come from a :class:`~inference_engine.platforms.device_info.DeviceInfoSource`
(torch's runtime, or a simulated machine in tests), never straight from torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch

from inference_engine.platforms.device_info import (
    DeviceInfoSource,
    DeviceProperties,
    device_info_for,
)

__all__ = ["MemoryProfiler", "Platform"]

# FP8 flavour names as the quant methods and ``env`` spell them.
FP8_FLAVOURS = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}

# Kernel names shared by platforms, quant methods and ``env``.
KERNEL_DEQUANT_MATMUL = "dequantize + torch matmul"
KERNEL_SCALED_MM_FP8 = "torch._scaled_mm (fp8)"
KERNEL_SCALED_MM_FP4 = "torch._scaled_mm (fp4 block-scaled)"
KERNEL_TRITON_FP8 = "triton fp8 gemm"
KERNEL_TRITON_FP8_BLOCK = "triton fp8 block gemm"
KERNEL_TRITON_MXFP4 = "triton mxfp4 (tl.dot_scaled)"
KERNEL_INT8_MM = "torch._int_mm (int8 x int8)"
KERNEL_TRITON_INT_WEIGHT_ONLY = "triton int4/int8 weight-only gemm"


class MemoryProfiler(ABC):
    """What the engine reads to size the KV pool as vLLM does: after a profiling
    forward at the step's token budget, the pool gets what the memory fraction leaves."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Start a new peak measurement."""

    @abstractmethod
    def allocated(self) -> int:
        """Bytes held by this process's tensors now."""

    @abstractmethod
    def peak_allocated(self) -> int:
        """Most bytes held by tensors since :meth:`reset_peak`."""

    @abstractmethod
    def reserved(self) -> int:
        """Bytes the tensor allocator holds from the device (allocated plus its cache)."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return the allocator's unused cached blocks to the device."""


class Platform(ABC):  # noqa: B024 - every method has a working default
    """A hardware platform and the devices of it this engine was told to use."""

    # Registration name (``--platform``).
    name: ClassVar[str] = ""
    # torch device type ("cpu", "cuda", "xpu"; ROCm devices are "cuda" in torch).
    device_type: ClassVar[str] = "cpu"
    # Among present platforms the highest priority is chosen.
    priority: ClassVar[int] = 0
    # Which device-info source this platform reads (see device_info.device_info_for).
    device_info_kind: ClassVar[str] = "cpu"
    # Environment variables that hide devices from this runtime (never set by the engine).
    visible_devices_env_vars: ClassVar[tuple[str, ...]] = ()

    def __init__(self, device_ids: list[int] | None = None) -> None:
        """Bind to ``device_ids`` (default: device 0).

        Raises:
            InvalidDeviceIdsError: an id is negative, repeated or out of range;
                the message names the available devices.
        """
        from inference_engine.config import visible_devices_from_env
        from inference_engine.platforms.device_ids import (
            validate_device_ids,
            visible_devices_notice,
        )

        self.info: DeviceInfoSource = type(self).device_info()
        visible = visible_devices_from_env(self.visible_devices_env_vars)
        visible_devices_notice(visible)
        names = [self.info.properties(i).name for i in range(self.info.device_count())]
        self.device_ids = validate_device_ids(
            list(device_ids) if device_ids else [0], self.name, names, visible
        )

    # ---- presence -------------------------------------------------------
    @classmethod
    def make_device_info(cls) -> DeviceInfoSource:
        """The real (torch-backed) source of this platform's device facts."""
        from inference_engine.platforms.device_info import CpuDeviceInfo

        return CpuDeviceInfo()

    @classmethod
    def device_info(cls) -> DeviceInfoSource:
        """The source in effect: the real one, or the simulated machine's."""
        return device_info_for(cls.device_info_kind, cls.make_device_info)

    @classmethod
    def is_present(cls) -> bool:
        """Whether this platform's hardware (and its torch build) is usable here."""
        return cls.device_info().device_count() > 0

    @classmethod
    def absence_reason(cls) -> str:
        """Why :meth:`is_present` is False, for the ``--platform`` error."""
        if cls.device_info().simulated:
            return "the simulated machine has none"
        return "no devices found"

    # ---- devices --------------------------------------------------------
    def device(self, rank: int = 0) -> torch.device:
        """The torch device for a worker rank, honouring ``--device-ids``."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.device_ids[rank])

    def device_count(self) -> int:
        """Devices of this platform visible to the process (not only the selected ones)."""
        return self.info.device_count()

    def properties(self, index: int | None = None) -> DeviceProperties:
        """Facts of visible device ``index``; None: the first selected device."""
        return self.info.properties(self.device_ids[0] if index is None else index)

    def device_name(self, index: int | None = None) -> str:
        return self.properties(index).name

    def device_names(self) -> list[str]:
        return [self.info.properties(i).name for i in range(self.device_count())]

    def capability(self) -> tuple[int, int] | None:
        """CUDA compute capability of the first selected device; None off NVIDIA."""
        return None

    def arch_name(self) -> str:
        """Architecture string (``sm90``, ``gfx942``, an XPU's name); empty where meaningless."""
        return ""

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the first selected device."""
        return self.info.memory_info(self.device_ids[0])

    # ---- numerics -------------------------------------------------------
    def supported_dtypes(self) -> list[torch.dtype]:
        """Dtypes the device computes in natively, preferred first."""
        return [torch.float32, torch.bfloat16, torch.float16]

    def fp8_dtype(self) -> torch.dtype | None:
        """The FP8 E4M3 flavour this device computes with, or None without FP8 math."""
        return None

    def fp8_flavour(self) -> str | None:
        """``"e4m3fn"`` (OCP), ``"e4m3fnuz"`` (MI300) or None."""
        dtype = self.fp8_dtype()
        return None if dtype is None else FP8_FLAVOURS[dtype]

    def fp8_max(self) -> float | None:
        """Largest finite value of :meth:`fp8_dtype` (448 for e4m3fn, 240 for e4m3fnuz)."""
        dtype = self.fp8_dtype()
        return None if dtype is None else float(torch.finfo(dtype).max)

    def fp8_scale_adjustment(self) -> float:
        """Factor on a scale when e4m3fn checkpoint bytes are reinterpreted as :meth:`fp8_dtype`.

        The same bits mean half the value in e4m3fnuz (exponent bias 8, not 7),
        so such scales double; 1.0 wherever no conversion is needed.
        """
        return 2.0 if self.fp8_dtype() == torch.float8_e4m3fnuz else 1.0

    def supports_fp8(self) -> bool:
        return self.fp8_dtype() is not None

    def supports_fp4(self) -> bool:
        """Whether the device has FP4 (E2M1, MX/NV block-scaled) matrix math."""
        return False

    def supports_triton(self) -> bool:
        """Whether Triton kernels can be compiled for this device."""
        return False

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype to compute in when the model asks for ``dtype`` (a slow one may be widened)."""
        return dtype

    # ---- kernels --------------------------------------------------------
    def attention_backends(self) -> list[str]:
        """Attention backend names this platform can run, best first.

        ``attention_backend="auto"`` takes the first one that supports the layer
        (head size, sinks, sliding window, KV cache dtype); ``torch_sdpa`` is the
        portable reference every backend is tested against.
        """
        return ["triton", "torch_sdpa"] if self.supports_triton() else ["torch_sdpa"]

    def fused_op_kernels(self) -> list[str]:
        """Implementations of the small fused layer ops (add+RMSNorm, SiLU*mul, rotary), best
        first: ``"cpu"`` (C++ kernels), ``"triton"``, ``"torch"`` (always works).

        Layers choose one when they are built, never per call.
        """
        return ["triton", "torch"] if self.supports_triton() else ["torch"]

    def moe_kernels(self) -> list[str]:
        """Fused-MoE expert kernels, best first: ``"triton"`` or ``"torch"`` (always works)."""
        return ["triton", "torch"] if self.supports_triton() else ["torch"]

    def supports_graph_capture(self) -> bool:
        """Whether whole decode steps can be captured and replayed (CUDA/HIP graphs)."""
        return False

    def pinned_memory(self) -> bool:
        """Whether host tensors should be page-locked for asynchronous uploads (a real
        accelerator's)."""
        return self.device_type != "cpu" and not self.info.simulated

    def synchronize(self) -> None:  # noqa: B027 - nothing to wait for on the host
        """Wait for the device's queued work (timing, profiling)."""

    def capture_graph(self, fn: Callable[[], Any], pool: Any = None) -> tuple[Any, Any, Any]:
        """Capture ``fn``'s device work as a replayable graph (``graph.replay()``).

        Returns ``(graph, fn's output, memory pool)``; pass the pool to the next capture
        so graphs share memory. Only called where :meth:`supports_graph_capture`.
        """
        raise NotImplementedError(f"the {self.name} platform cannot capture graphs")

    def forbid_host_sync(self) -> AbstractContextManager[None]:
        """A context in which a host synchronisation with the device raises (checks that a
        step can be captured); a no-op where the device is the host."""
        return nullcontext()

    def distributed_backend(self) -> str:
        """The torch.distributed backend for this platform's devices (tensor/expert parallel
        collectives): gloo on the host; device platforms answer their own (NCCL, RCCL...)."""
        return "gloo"

    def ray_actor_resources(self) -> dict[str, float]:
        """What one rank's Ray actor asks the cluster for (one device: ``{"num_gpus": 1}``)."""
        return {"num_cpus": 0}

    def supports_async_scheduling(self) -> bool:
        """Whether the device runs work asynchronously to the host, so scheduling the next
        step while this one runs pays (the default for ``async_scheduling``)."""
        return False

    def record_event(self) -> Any:
        """A marker of the work queued so far, with ``synchronize()`` to wait for it; None
        where work is done when the call returns (the host)."""
        return None

    def default_max_num_seqs(self) -> int:
        """``max_num_seqs`` when none is given: what a step of this device handles well."""
        return 128

    def memory_profiler(self) -> MemoryProfiler | None:
        """Device-memory accounting for sizing the KV pool from a profiling forward
        (``gpu_memory_utilization``); None where memory is not profiled (the host)."""
        return None

    def fp8_gemm_kernels(self) -> list[str]:
        """FP8 x FP8 matmul paths the device runs natively, best first (empty: none)."""
        return []

    def fp4_gemm_kernels(self) -> list[str]:
        """FP4 matmul paths the device runs natively, best first (empty: none)."""
        return []

    def int_gemm_kernels(self) -> list[str]:
        """Integer matmul paths, best first (empty: none): ``torch._int_mm`` for INT8 W8A8 and
        the Triton weight-only GEMM for int4/int8 weights (AWQ, GPTQ, compressed-tensors).
        Without either, those weights dequantize in torch."""
        return []

    def quant_kernels(self) -> list[str]:
        """Every quantized-matmul path available here; dequantize + matmul always is."""
        return [*self.fp8_gemm_kernels(), *self.fp4_gemm_kernels(), *self.int_gemm_kernels(),
                KERNEL_DEQUANT_MATMUL]

    def kernel_tuning_default(self, op_name: str, shape: dict[str, int]) -> dict[str, Any] | None:
        """Fallback tuning answer when no plugin answers ``ie_kernel_tuning_config``."""
        return None

    # ---- process --------------------------------------------------------
    def set_up_process(self) -> None:  # noqa: B027 - optional hook
        """Per-process numeric settings (flush denormals, ...); called at engine start."""

    def build_kernels(self) -> float:
        """Compile the platform's own kernels before the model's layers ask for them (all of
        them side by side, one compiler per core, instead of one after another as each
        layer is built); called at engine start. Returns the seconds it took (0.0: none,
        or all were already built)."""
        return 0.0

    def describe(self) -> dict[str, Any]:
        """Everything above as plain JSON data (``inference-engine env``)."""
        free, total = self.memory_info()
        return {
            "name": self.name,
            "device_type": self.device_type,
            "simulated": self.info.simulated,
            "device_count": self.device_count(),
            "devices": [
                {"index": i, "name": p.name, "total_memory_bytes": p.total_memory}
                for i, p in enumerate(self.info.properties(j) for j in range(self.device_count()))
            ],
            "selected_device_ids": list(self.device_ids),
            "capability": list(cap) if (cap := self.capability()) else None,
            "arch": self.arch_name(),
            "memory": {"free_bytes": free, "total_bytes": total},
            "supported_dtypes": [str(d).removeprefix("torch.") for d in self.supported_dtypes()],
            "fp8_dtype": self.fp8_flavour(),
            "fp8_max": self.fp8_max(),
            "fp8_scale_adjustment": self.fp8_scale_adjustment(),
            "fp4": self.supports_fp4(),
            "triton": self.supports_triton(),
            "attention_backends": self.attention_backends(),
            "fp8_gemm_kernels": self.fp8_gemm_kernels(),
            "fp4_gemm_kernels": self.fp4_gemm_kernels(),
            "quant_kernels": self.quant_kernels(),
        }
