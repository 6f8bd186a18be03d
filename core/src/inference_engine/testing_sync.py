"""A guard that fails when code inside it reads a tensor back to the host.

On a GPU every ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``,
``nonzero()`` or other op whose output shape depends on tensor values stalls
the CPU until the device catches up, and breaks CUDA-graph capture. The engine
reads the sampled ids back once per step; everything before that must be free
of such reads. Tests wrap a step's pieces in :class:`no_host_sync`::

    with no_host_sync():
        ids = sampler.sample_ids(logits, batch)

On the CPU every tensor is a host tensor, so the rule is about calls, not
devices: each call listed below is a sync on any tensor, except ``.to(...)`` /
``.cpu()`` / ``.numpy()`` / ``copy_`` of a tensor built from host data inside
the guard (``torch.tensor(list)``, ``torch.as_tensor``, ``torch.from_numpy``)
or handed to :meth:`no_host_sync.allow`. On CUDA the guard also turns on
``torch.cuda.set_sync_debug_mode("error")``, which catches syncs made inside
C++ ops that this Python-level guard cannot see.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncError", "no_host_sync"]

_T = torch.Tensor

# Always a host read: the value (or the output's size) comes from tensor data.
_READS: dict[Callable[..., Any], str] = {
    _T.item: "Tensor.item()",
    _T.tolist: "Tensor.tolist()",
    _T.__bool__: "bool(tensor)",
    _T.__int__: "int(tensor)",
    _T.__float__: "float(tensor)",
    _T.__index__: "tensor used as an index (__index__)",
    _T.__complex__: "complex(tensor)",
    torch.nonzero: "torch.nonzero",
    _T.nonzero: "Tensor.nonzero()",
    torch.argwhere: "torch.argwhere",
    _T.argwhere: "Tensor.argwhere()",
    torch.masked_select: "torch.masked_select",
    _T.masked_select: "Tensor.masked_select()",
    torch.unique: "torch.unique",
    _T.unique: "Tensor.unique()",
    torch.unique_consecutive: "torch.unique_consecutive",
    _T.unique_consecutive: "Tensor.unique_consecutive()",
    # NOTE: on CUDA bincount reads the input's maximum to size its output, even with minlength.
    torch.bincount: "torch.bincount",
    _T.bincount: "Tensor.bincount()",
}
# Host copies: allowed only for tensors built from host data.
_COPIES: dict[Callable[..., Any], str] = {
    _T.cpu: "Tensor.cpu()",
    _T.numpy: "Tensor.numpy()",
}
# Constructors whose result is host data (when not given a tensor to copy).
_HOST_BUILDERS = (torch.tensor, torch.as_tensor, torch.from_numpy)
_REPEAT_INTERLEAVE = (torch.repeat_interleave, _T.repeat_interleave)


class HostSyncError(RuntimeError):
    """A tensor was read on the host inside :class:`no_host_sync`; the message names the call."""


def _is_cpu(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """The device ``Tensor.to(*args, **kwargs)`` moves to, or None when it keeps the device."""
    if "device" in kwargs:
        return kwargs["device"]
    for arg in args[1:]:
        if isinstance(arg, (torch.device, str)):
            return arg
        if isinstance(arg, torch.Tensor):  # .to(other): other's device
            return arg.device
    return None


class no_host_sync(TorchFunctionMode):  # noqa: N801 - used as a context manager, like no_grad
    """Raise :class:`HostSyncError` on any host read of a tensor made inside the block.

    Args:
        cuda_debug: also set ``torch.cuda.set_sync_debug_mode("error")`` for the
            block when CUDA is initialised (restored on exit). None: when available.
    """

    def __init__(self, cuda_debug: bool | None = None) -> None:
        super().__init__()
        self._cuda_debug = cuda_debug
        self._saved_debug_mode: int | None = None
        # id -> weak reference of each tensor that holds host data (see allow()).
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    def allow(self, *tensors: torch.Tensor) -> None:
        """Treat ``tensors`` as host data: copying them (to any device) is not a sync."""
        for t in tensors:
            key = id(t)
            self._host[key] = weakref.ref(t, lambda _, key=key: self._host.pop(key, None))

    def _is_host_data(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def __enter__(self) -> no_host_sync:
        use_cuda = self._cuda_debug
        if use_cuda is None:
            use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if use_cuda:
            self._saved_debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._saved_debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._saved_debug_mode)
            self._saved_debug_mode = None

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _HOST_BUILDERS and not (args and isinstance(args[0], torch.Tensor)):
            self.allow(out)
        elif func is _T.pin_memory and self._is_host_data(args[0]):
            self.allow(out)
        return out

    def _check(self, func: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        name = _READS.get(func)
        if name is None and func in _COPIES and not self._is_host_data(args[0]):
            name = _COPIES[func]
        elif func is _T.to and not self._is_host_data(args[0]):
            if _is_cpu(_target_device(args, kwargs)):
                name = "Tensor.to(cpu)"
        elif func is _T.copy_ and not self._is_host_data(args[1]):
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type != "cpu":
                name = "Tensor.copy_ from the device to the host"
        elif func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            # A tensor of repeats (or the one-argument form) sizes the output from data.
            if repeats is None or isinstance(repeats, torch.Tensor):
                name = "repeat_interleave without output_size"
        elif func is _T.__getitem__ and _has_mask_index(args[1]):
            name = "indexing with a boolean mask"
        elif func is torch.where and len(args) + len(kwargs) == 1:
            name = "torch.where(condition) (nonzero)"
        if name is not None:
            raise HostSyncError(f"host synchronisation inside no_host_sync: {name}")


def _has_mask_index(index: object) -> bool:
    """Whether a ``__getitem__`` index holds a bool tensor (a data-dependent output size)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
