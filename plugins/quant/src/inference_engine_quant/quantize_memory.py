"""How many bytes a loaded model's weights take, split into quantized linears and the rest.

Works for any quantization method: linear layers report through their
method's ``weight_memory_bytes`` (packed values, scales, bias); everything
else (embeddings, norms, LM head) is counted from its parameters. The bf16
figure is what the same linears would take as dense bf16, for the ratio the
benchmarks report.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_engine.layers.linear import LinearBase
from torch import nn

__all__ = ["WeightMemoryReport", "weight_memory_report"]


@dataclass(frozen=True)
class WeightMemoryReport:
    """Weight bytes of one model at run time."""

    # Linear layers (the ones a quantization method owns), as stored.
    linear_bytes: int
    # The same linear layers as dense bf16 weights (and bf16 biases).
    linear_bf16_bytes: int
    # Every other parameter (embeddings, norms, LM head), as stored.
    other_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.other_bytes

    @property
    def linear_ratio_vs_bf16(self) -> float:
        return self.linear_bytes / self.linear_bf16_bytes if self.linear_bf16_bytes else 1.0

    def format(self) -> str:
        mib = 1 << 20
        return (f"linear weights {self.linear_bytes / mib:.2f} MiB "
                f"({self.linear_ratio_vs_bf16:.3f}x of bf16 "
                f"{self.linear_bf16_bytes / mib:.2f} MiB), "
                f"other {self.other_bytes / mib:.2f} MiB, total {self.total_bytes / mib:.2f} MiB")


def weight_memory_report(model: nn.Module) -> WeightMemoryReport:
    """Count the bytes of ``model``'s weights (parameters; tied ones once)."""
    linear = linear_bf16 = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, LinearBase):
            linear += module.quant_method.weight_memory_bytes(module)
            linear_bf16 += 2 * module.input_size * module.output_size
            if module.bias is not None:
                linear_bf16 += 2 * module.output_size
            seen.update(id(p) for p in module.parameters(recurse=False))
    other = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            other += p.numel() * p.element_size()
    return WeightMemoryReport(linear, linear_bf16, other)
