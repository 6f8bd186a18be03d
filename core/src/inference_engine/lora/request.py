"""Which LoRA adapter a request runs with: vLLM's ``LoRARequest``, so user code can switch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoRARequest"]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Args:
        lora_name: the adapter's name (the server's model name for it).
        lora_int_id: a positive id, unique per adapter; the engine caches by it.
        lora_path: the adapter directory.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def prefix_salt(self) -> int:
        """Seeds the prefix-cache keys of this adapter's requests: K/V computed with an
        adapter are only reused by requests with the same adapter."""
        return hash(("lora", self.lora_int_id, self.lora_path))
