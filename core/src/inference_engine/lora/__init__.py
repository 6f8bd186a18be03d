"""Multi-LoRA serving: PEFT adapters applied per request, many adapters in one batch.

``LoRARequest`` names an adapter; :mod:`.adapter` reads and checks it,
:mod:`.manager` keeps adapters in host memory and device slots,
:mod:`.layer` adds each token's delta in the linear layers, and
:mod:`.grouped_matmul` is the grouped shrink/expand reference.
"""

from inference_engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
