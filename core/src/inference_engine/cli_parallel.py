"""The parallelism flags of ``serve`` and ``generate`` (vLLM's names), declared once.

``-tp 2`` runs the model over two ranks (tensor parallelism), ``--enable-expert-parallel``
places MoE experts over them, ``--distributed-executor-backend`` says who starts the
ranks (docs/distributed.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

__all__ = ["All2AllBackendOption", "DataParallelSizeOption", "DistributedExecutorBackendOption",
           "EnableExpertParallelOption", "TensorParallelSizeOption", "parallel_kwargs"]

TensorParallelSizeOption = Annotated[int, typer.Option(
    "--tensor-parallel-size", "-tp", min=1,
    help="Ranks the model is split over (tensor parallelism: attention heads, MLP widths, "
         "vocabulary); one device each.")]
DataParallelSizeOption = Annotated[int, typer.Option(
    "--data-parallel-size", "-dp", min=1,
    help="Data-parallel engines (each its own scheduler and KV cache over -tp ranks, MoE in "
         "lockstep); with mp / ray a front end sends each request to the one with the "
         "shortest queue; under torchrun each process group is one.")]
EnableExpertParallelOption = Annotated[bool, typer.Option(
    "--enable-expert-parallel",
    help="Place MoE experts over the ranks (whole experts) instead of splitting each one.")]
DistributedExecutorBackendOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    "--distributed-executor-backend",
    help="Who starts the ranks: mp (processes on this node; the default), ray (actors on a "
         "Ray cluster) or external_launcher (torchrun started every rank).")]
All2AllBackendOption = Annotated[str, typer.Option(
    "--all2all-backend",
    help="Expert-parallel transport: allgather_reducescatter (every rank runs its experts "
         "over all tokens, outputs summed) or alltoall (each token sent once per owning "
         "rank and back).")]


def parallel_kwargs(tensor_parallel_size: int, data_parallel_size: int,
                    enable_expert_parallel: bool, distributed_executor_backend: str | None,
                    all2all_backend: str) -> dict[str, Any]:
    """The engine keywords of the flags above."""
    return dict(tensor_parallel_size=tensor_parallel_size,
                data_parallel_size=data_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
                distributed_executor_backend=distributed_executor_backend,
                all2all_backend=all2all_backend)
