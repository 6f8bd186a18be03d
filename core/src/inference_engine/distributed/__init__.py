"""Tensor, expert and data parallelism over torch.distributed, and the executors that start
the ranks (docs/distributed.md)."""
