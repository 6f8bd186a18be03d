"""Data parallelism with attention per rank: DP engines whose MoE layers run in lockstep.

Each data-parallel rank is a whole engine (scheduler, KV cache, sampler) over its own
requests and its TP group; only expert-parallel MoE layers span every rank, so every
DP rank must run a forward whenever any does. :class:`LockstepRunner` keeps that
rule (as vLLM's DP engine cores): before each forward a rank announces it (a host
all-reduce over the DP group), and a rank whose step ran none joins the same round
with a dummy forward (one padding token written to the null KV block, nothing
sampled). :func:`generate_data_parallel` is the SPMD driver for torchrun: every
rank passes the same prompts, each takes a share balanced by queued work, all step
until every rank is done, and every rank returns every output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference_engine.distributed.collectives import GroupCollectives

__all__ = ["LockstepRunner", "balance_by_queue", "generate_data_parallel"]


def dummy_batch() -> Any:
    """One decode row with no context, writing the null block (id 0, never handed out)."""
    from inference_engine.engine.model_runner import StepBatch

    return StepBatch(token_ids=[[0]], num_computed=[0], query_lens=[1], block_lists=[[0]],
                     sample_rows=[], prompt_rows=[])


class LockstepRunner:
    """The model runner of one DP rank, its forwards matched round by round with the other
    DP ranks' (every other attribute is the runner's own)."""

    def __init__(self, runner: Any, dp: GroupCollectives) -> None:
        self._runner = runner
        self._dp = dp
        self._ran = False
        self.dummy_forwards = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute_batch(self, batch: Any) -> Any:
        self._dp.host_sum([1])  # "this rank runs a forward this round"
        self._ran = True
        return self._runner.execute_batch(batch)

    def end_round(self) -> None:
        """After this rank's engine step: join the round with a dummy forward if another DP
        rank ran one and this rank did not."""
        if not self._ran and self._dp.host_sum([0])[0] > 0:
            self._runner.execute_batch(dummy_batch())
            self.dummy_forwards += 1
        self._ran = False


def balance_by_queue(costs: Sequence[int], ranks: int) -> list[int]:
    """The DP rank of each request: each goes to the rank with the least queued work so far
    (prompt plus output tokens), ties to the lowest rank; the same answer on every rank."""
    queued = [0] * ranks
    owners = []
    for cost in costs:
        rank = min(range(ranks), key=lambda r: (queued[r], r))
        queued[rank] += cost
        owners.append(rank)
    return owners


def generate_data_parallel(llm: Any, prompts: Sequence[Any], params: Any) -> list[Any]:
    """``llm.generate`` for a data-parallel job started by torchrun: call it on every rank
    with the same arguments; returns every prompt's output (in order) on every rank.

    Raises:
        ValueError: the engine is not a data-parallel one.
    """
    from inference_engine.distributed.parallel_state import parallel_state

    engine = llm.engine
    runner = engine.runner
    dp = parallel_state().dp
    if not isinstance(runner, LockstepRunner):
        raise ValueError("generate_data_parallel needs data_parallel_size > 1 under "
                         "distributed_executor_backend='external_launcher'")
    texts = [engine.tokenize_prompt(p)[1] for p in prompts]
    owners = balance_by_queue([len(t) + (params.max_tokens or 0) for t in texts], dp.size)
    mine = {}
    for index, (prompt, owner) in enumerate(zip(prompts, owners, strict=True)):
        if owner == dp.rank:
            mine[engine.add_request(prompt, params, request_id=f"dp-{index}",
                                    final_only=True)] = index
    finished: dict[int, Any] = {}
    while dp.host_sum([int(engine.has_unfinished_requests())])[0]:
        for output in engine.step():
            if output.finished:
                finished[mine[output.request_id]] = output
        runner.end_round()
    gathered: dict[int, Any] = {}
    for part in dp.all_gather_object(finished):
        gathered.update(part)
    return [gathered[i] for i in range(len(prompts))]
