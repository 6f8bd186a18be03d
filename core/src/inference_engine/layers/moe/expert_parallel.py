"""Expert parallelism: which experts a rank holds, and moving tokens to them and back.

With ``--enable-expert-parallel`` the ``E`` experts of a layer are placed in
contiguous blocks of ``E / ep`` over the EP ranks (:class:`ExpertPlacement`),
whole (not TP-sliced). Every rank has routed every token (the router is
replicated); two transports bring each (token, expert) assignment to the rank
that owns the expert and the weighted outputs back, and neither drops a token
(capacity-free: buffers are sized by the step's actual counts, exchanged first):

- :func:`allgather_reducescatter_experts`: the data-parallel ranks' tokens are
  all-gathered (with one DP rank, the replicated batch already is), every rank runs
  its own experts' assignments, and the partial outputs are summed over the EP group
  (an all-reduce; each rank then keeps its own rows).
- :func:`alltoall_experts`: each rank takes its share of the tokens, sends each
  token **once per destination rank** with the (local expert, weight) of every
  slot that rank owns (``all_to_all_single`` with uneven splits, counts
  exchanged first), the owner runs its experts and sends the weighted sums back
  (the reverse all-to-all), and the shares are all-gathered.

Both reduce to :func:`run_local_assignments`, which runs only assignments whose
expert is local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference_engine.distributed.collectives import GroupCollectives

__all__ = ["ExpertPlacement", "allgather_reducescatter_experts", "alltoall_experts",
           "run_local_assignments"]

# (x [M, K], weights [M, 1], ids [M, 1]) -> [M, K_out]: the layer's expert kernel over its
# local experts.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertPlacement:
    """Experts ``[start, start + num_local)`` of ``num_experts`` live on this EP rank."""

    num_experts: int
    ep_size: int
    ep_rank: int

    def __post_init__(self) -> None:
        if self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts do not split evenly over "
                             f"{self.ep_size} expert-parallel ranks")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def start(self) -> int:
        return self.ep_rank * self.num_local

    def local_index(self, expert: int) -> int | None:
        """The local slot of global ``expert``, or None when another rank owns it."""
        local = expert - self.start
        return local if 0 <= local < self.num_local else None

    def global_to_local(self) -> torch.Tensor:
        """``[num_experts]`` int64 map: local slot, or -1 for a remote expert."""
        table = torch.full((self.num_experts,), -1, dtype=torch.int64)
        table[self.start:self.start + self.num_local] = torch.arange(self.num_local)
        return table


def run_local_assignments(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor,
                          experts: LocalExperts) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{local_ids[t, k]}(x[t])`` over the slots whose expert
    is local (``local_ids >= 0``); tokens with none get zeros. ``[T, K] -> [T, K_out]``."""
    token, slot = torch.nonzero(local_ids >= 0, as_tuple=True)
    out = torch.zeros_like(x)
    if token.numel() == 0:
        return out
    ys = experts(x.index_select(0, token), weights[token, slot].unsqueeze(1),
                 local_ids[token, slot].unsqueeze(1))
    return out.index_add_(0, token, ys.to(x.dtype))


def allgather_reducescatter_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                    placement: ExpertPlacement, table: torch.Tensor,
                                    experts: LocalExperts, ep: GroupCollectives,
                                    dp: GroupCollectives | None = None) -> torch.Tensor:
    """Every rank runs its experts over all tokens; the partial sums are summed over EP.

    With data parallelism (``dp``: ranks holding different tokens) the DP ranks' tokens
    are all-gathered first (padded to the longest, counts exchanged), and each keeps its
    own rows of the sum."""
    if dp is None or dp.size == 1:
        out = run_local_assignments(x, weights, table[ids], experts)
        return ep.all_reduce(out)
    t = x.shape[0]
    counts = dp.host_sum([t if r == dp.rank else 0 for r in range(dp.size)])
    longest = max(counts)

    def padded(a: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((longest, *a.shape[1:]), dtype=a.dtype, device=a.device)
        out[:t] = a
        return out

    all_x = dp.all_gather(padded(x))
    all_w = dp.all_gather(padded(weights))
    all_ids = dp.all_gather(padded(ids))
    local_ids = table[all_ids]
    valid = torch.cat([torch.arange(longest, device=x.device) < n for n in counts])
    local_ids.masked_fill_(~valid.unsqueeze(1), -1)  # padding rows route nowhere
    out = ep.all_reduce(run_local_assignments(all_x, all_w, local_ids, experts))
    return out[dp.rank * longest:dp.rank * longest + t]


def alltoall_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     placement: ExpertPlacement, table: torch.Tensor, experts: LocalExperts,
                     ep: GroupCollectives, token_group: GroupCollectives | None = None
                     ) -> torch.Tensor:
    """Dispatch this rank's share of tokens to the experts' owners, combine, all-gather.

    ``token_group``: the ranks that hold the same tokens (the TP group; the whole EP group
    without data parallelism); the tokens are shared out over it and gathered back."""
    share_group = token_group if token_group is not None else ep
    t, k = ids.shape
    size = ep.size
    share = -(-t // share_group.size)  # tokens per rank; the last share may be short
    lo, hi = min(t, share_group.rank * share), min(t, (share_group.rank + 1) * share)
    my_x, my_w, my_ids = x[lo:hi], weights[lo:hi], ids[lo:hi]
    n = hi - lo
    owner = torch.div(my_ids, placement.num_local, rounding_mode="floor")  # [n, k]
    # One row per (token, destination rank) that some slot of the token goes to.
    wants = torch.zeros(n, size, dtype=torch.bool, device=x.device)
    if n:
        wants.scatter_(1, owner, True)
    dest_rank, token = torch.nonzero(wants.t(), as_tuple=True)  # grouped by destination
    send_counts = torch.bincount(dest_rank, minlength=size)
    recv_counts = ep.exchange_counts(send_counts)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    # Each sent row carries its k slots: the destination's local expert id (or -1: a slot
    # another rank owns) and the routing weight.
    mine = owner[token] == dest_rank.unsqueeze(1)  # [rows, k]
    slot_ids = torch.where(mine, my_ids[token] - (dest_rank * placement.num_local).unsqueeze(1),
                           torch.full_like(my_ids[token], -1))
    slot_w = torch.where(mine, my_w[token], torch.zeros_like(my_w[token]))
    recv_x = ep.all_to_all(my_x[token], send_splits, recv_splits)
    recv_ids = ep.all_to_all(slot_ids, send_splits, recv_splits)
    recv_w = ep.all_to_all(slot_w.float(), send_splits, recv_splits).to(weights.dtype)
    done = run_local_assignments(recv_x, recv_w, recv_ids, experts)
    back = ep.all_to_all(done, recv_splits, send_splits)  # the reverse exchange
    mine_out = torch.zeros_like(my_x).index_add_(0, token, back)
    if share_group.size == 1:
        return mine_out
    padded = torch.zeros(share, x.shape[1], dtype=x.dtype, device=x.device)
    padded[:n] = mine_out
    return share_group.all_gather(padded)[:t]
