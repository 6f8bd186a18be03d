"""The ``gguf`` weight format: a lone ``.gguf`` file (or a folder holding one).

Config, tensors and tokenizer all come from the one file. Linear-layer weights
are handed to the model in their stored GGML form (raw blocks) and stay that
way: the config's ``quantization_config`` names the ``gguf`` quantization
method and lists each such tensor's GGML type, so the method allocates exactly
those bytes. Everything else (norms, biases) is dequantized to float32 here;
the token embedding and LM head are loaded dense first and then swapped for
their raw blocks by the method (see :mod:`inference_engine_gguf.quant_method`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch
from inference_engine.interfaces.weight_format import WeightFormat

from inference_engine_gguf.architectures import (
    architecture_spec,
    build_hf_config,
    hf_tensor_names,
    is_qk_weight,
    unpermute_rows,
)
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.ggml_types import check_supported
from inference_engine_gguf.gguf_file import GGUFFile

__all__ = ["GGUFFormat", "RAW_LINEAR_RE"]

# transformers names of dense linear weights that stay in their GGML blocks.
RAW_LINEAR_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
# Stacked expert tensor -> its part in the MoE layer.
EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")
# Dense modules the quant method swaps for raw-block versions after loading.
EMBEDDING_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                     "output.weight": "lm_head.weight"}


class GGUFFormat(WeightFormat):
    """Reads one GGUF file through the ``gguf`` package (llama.cpp's own reader)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.file = GGUFFile(path)
        self.spec = architecture_spec(self.file.architecture)
        # Every tensor's type must be one we can hold, before anything is built.
        for info in self.file.tensors.values():
            check_supported(info.qtype, info.name)

    @cached_property
    def _config(self) -> dict[str, Any]:
        return build_hf_config(self.file)

    def _hf_names(self, ggml_name: str) -> list[str] | None:
        return hf_tensor_names(ggml_name, int(self._config.get("num_experts", 0)))

    def load_config(self) -> dict[str, Any]:
        config = dict(self._config)
        tensor_types: dict[str, str] = {}
        embedding_types: dict[str, str] = {}
        expert_types: dict[str, dict[str, str]] = {}
        for info in self.file.tensors.values():
            expert = _EXPERT_RE.match(info.name)
            if expert is not None:
                prefix = f"model.layers.{expert.group(1)}.mlp.experts"
                expert_types.setdefault(prefix, {})[EXPERT_PARTS[expert.group(2)]] = info.qtype.name
                continue
            if info.name in EMBEDDING_TENSORS:
                embedding_types[EMBEDDING_TENSORS[info.name]] = info.qtype.name
                continue
            for name in self._hf_names(info.name) or ():
                if RAW_LINEAR_RE.match(name):
                    tensor_types[name] = info.qtype.name
        config["quantization_config"] = {
            "quant_method": "gguf",
            "gguf_file": self.file.path,
            "tensor_types": tensor_types,
            "embedding_types": embedding_types,
            # Experts stay raw where gate and up share a type (they are fused in one tensor).
            "expert_types": {p: t for p, t in expert_types.items()
                             if len(t) == 3 and t["gate"] == t["up"]},
        }
        return config

    def tensor_names(self) -> list[str]:
        names: list[str] = []
        for ggml_name in self.file.tensors:
            names.extend(self._hf_names(ggml_name) or ())
        return names

    def read_raw(self, ggml_name: str) -> torch.Tensor:
        """A tensor's stored form with llama's q/k row permutation undone."""
        raw = self.file.raw(ggml_name)
        part = is_qk_weight(ggml_name)
        if self.spec.permutes_qk and part is not None:
            cfg = self._config
            heads = cfg["num_attention_heads"] if part == "q" else cfg["num_key_value_heads"]
            raw = unpermute_rows(raw, heads)
        return raw

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        quant = self.load_config()["quantization_config"]
        raw_names, raw_experts = quant["tensor_types"], quant["expert_types"]
        for ggml_name, info in self.file.tensors.items():
            names = self._hf_names(ggml_name)
            if not names:
                continue
            raw = self.read_raw(ggml_name)
            if len(names) == 1 and names[0] in raw_names:
                yield names[0], raw
                continue
            expert = _EXPERT_RE.match(ggml_name)
            if expert is not None and f"model.layers.{expert.group(1)}.mlp.experts" in raw_experts:
                yield from zip(names, raw.unbind(0), strict=True)
                continue
            dense = dequantize(raw, info.qtype)
            if len(names) == 1:
                yield names[0], dense
            else:  # stacked experts [E, N, K]
                yield from zip(names, dense.unbind(0), strict=True)

    def load_tokenizer(self) -> Any | None:
        from inference_engine_gguf.tokenizer import build_tokenizer

        return build_tokenizer(self.file)

    def generation_config(self) -> dict[str, Any]:
        eos = [self.file.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
        eos_ids = sorted({int(e) for e in eos if e is not None})
        out: dict[str, Any] = {}
        if eos_ids:
            out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        bos = self.file.get("tokenizer.ggml.bos_token_id")
        if bos is not None:
            out["bos_token_id"] = int(bos)
        return out
