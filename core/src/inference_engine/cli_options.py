"""Command-line options several commands share (``generate``, ``serve``, ``bench``), declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

__all__ = ["AsyncSchedulingOption", "EnforceEagerOption", "GpuMemoryUtilizationOption"]

GpuMemoryUtilizationOption = Annotated[float, typer.Option(
    min=0.0, max=1.0, help="Fraction of GPU memory the engine may use; the KV cache gets "
                           "what weights and a profiling forward leave.")]
EnforceEagerOption = Annotated[bool, typer.Option(
    help="Never capture CUDA graphs (every step eager).")]
AsyncSchedulingOption = Annotated[Optional[bool], typer.Option(  # noqa: UP045 - typer needs Optional
    help="Launch each step before the previous one's tokens are read back; default: on for "
         "GPUs, off on CPU.")]
