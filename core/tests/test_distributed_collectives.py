"""The collectives wrapper and the expert-parallel transports on 2 gloo ranks (spawn, loopback).

One spawned job runs every check (a job costs seconds to start): each collective against
what it must equal by definition, and both expert-parallel transports against the
single-process MoE (every expert on one rank) on the same random routing, first with the
tokens replicated over the ranks (TP=2), then with different tokens per rank (DP=2).
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as tmp
from inference_engine.distributed.parallel_state import (
    destroy_parallel,
    init_parallel,
    parallel_state,
)
from inference_engine.layers.moe.expert_parallel import (
    ExpertPlacement,
    allgather_reducescatter_experts,
    alltoall_experts,
)
from inference_engine.layers.moe.torch_experts import fused_moe_torch
from inference_engine.testing import free_port

WORLD = 2


def _checks(rank: int) -> None:
    ep = parallel_state().world
    # all_reduce: the sum of every rank's tensor.
    t = torch.full((3,), float(rank + 1))
    assert torch.equal(ep.all_reduce(t), torch.full((3,), 3.0))
    # all_gather along dim 1 (the LM head's vocabulary), in rank order.
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    gathered = ep.all_gather(x, dim=1)
    assert torch.equal(gathered, torch.cat([x - 10 * rank, x - 10 * rank + 10], dim=1))
    # reduce_scatter: rank r keeps rows r of the sum.
    rows = torch.arange(4, dtype=torch.float32).view(2, 2) * (rank + 1)
    assert torch.equal(ep.reduce_scatter(rows), torch.arange(4.).view(2, 2)[rank:rank + 1] * 3)
    # all_to_all with uneven splits (rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 3 and 0).
    send = [[1, 2], [3, 0]][rank]
    counts = ep.exchange_counts(torch.tensor(send))
    assert counts.tolist() == [[1, 3], [2, 0]][rank]
    rows = torch.arange(sum(send), dtype=torch.int64) + 100 * rank
    got = ep.all_to_all(rows.unsqueeze(1), send, counts.tolist())[:, 0].tolist()
    assert got == [[0, 100, 101, 102], [1, 2]][rank]
    assert ep.broadcast_object({"step": rank} if rank == 0 else None) == {"step": 0}
    # The expert-parallel transports equal every expert on one rank.
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, k = 8, 16, 8, 7, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    expected = fused_moe_torch(x, gate_up, down, weights, ids)
    place = ExpertPlacement(experts, WORLD, rank)
    mine = slice(place.start, place.start + place.num_local)

    def local(xs, ws, local_ids):
        return fused_moe_torch(xs, gate_up[mine], down[mine], ws, local_ids)

    for transport in (allgather_reducescatter_experts, alltoall_experts):
        out = transport(x, weights, ids, place, place.global_to_local(), local, ep)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Fewer tokens than ranks: one rank's share is empty, nothing is dropped.
    out = alltoall_experts(x[:1], weights[:1], ids[:1], place, place.global_to_local(), local,
                           ep)
    torch.testing.assert_close(out, expected[:1], rtol=1e-5, atol=1e-5)


def _data_parallel_checks(rank: int) -> None:
    """DP=2 x TP=1: the ranks hold different tokens (5 and 2); both transports still equal
    every expert on one rank, each rank getting its own tokens' outputs."""
    state = parallel_state()
    assert state.dp.size == WORLD and state.tp.size == 1 and state.ep.size == WORLD
    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter, k = 4, 16, 8, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    tokens = [5, 2][rank]
    x = torch.randn(7, hidden, generator=gen)[[slice(0, 5), slice(5, 7)][rank]]
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(7)])
    ids = ids[[slice(0, 5), slice(5, 7)][rank]]
    weights = torch.rand(tokens, k, generator=gen)
    expected = fused_moe_torch(x, gate_up, down, weights, ids)
    place = ExpertPlacement(experts, WORLD, rank)
    mine = slice(place.start, place.start + place.num_local)

    def local(xs, ws, local_ids):
        return fused_moe_torch(xs, gate_up[mine], down[mine], ws, local_ids)

    table = place.global_to_local()
    out = allgather_reducescatter_experts(x, weights, ids, place, table, local, state.ep,
                                          state.dp)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out = alltoall_experts(x, weights, ids, place, table, local, state.ep, state.tp)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _rank_main(rank: int, port: int, second_port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_parallel(rank, WORLD, WORLD, enable_expert_parallel=True, timeout_s=60)
    try:
        _checks(rank)
    finally:
        destroy_parallel()
    init_parallel(rank, WORLD, 1, data_parallel_size=WORLD, enable_expert_parallel=True,
                  init_method=f"tcp://127.0.0.1:{second_port}", timeout_s=60)
    try:
        _data_parallel_checks(rank)
    finally:
        destroy_parallel()


def test_collectives_and_expert_transports_on_two_gloo_ranks():
    tmp.spawn(_rank_main, args=(free_port(), free_port()), nprocs=WORLD, join=True)
    # This process never joined: it still sees single-rank groups.
    assert parallel_state().world.size == 1
