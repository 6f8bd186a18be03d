"""Random PEFT adapters for tests and benchmarks (needs ``peft``, a test dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["ALL_TARGETS", "make_peft_adapter", "peft_reference"]

# Every module the engine adapts.
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base: str | Path, out: str | Path, seed: int, std: float = 0.3,
                      **lora: Any) -> Path:
    """Save under ``out`` a peft LoRA adapter (``lora``: ``LoraConfig`` fields) for the
    transformers model at ``base``, with random non-zero A and B (normal, ``std``) so the
    adapter changes greedy output."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(out)
    return Path(out)


def peft_reference(base: str | Path, adapter: str | Path | None) -> Any:
    """The transformers model at ``base`` with ``adapter`` applied by peft (None: plain)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()
