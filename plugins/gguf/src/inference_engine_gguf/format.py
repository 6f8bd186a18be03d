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

from inference_engine_gguf.architectures import architecture_spec, build_hf_config
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.ggml_types import check_supported
from inference_engine_gguf.gguf_file import GGUFFile
from inference_engine_gguf.tensor_names import (
    block_index,
    combine_parts,
    combined_target,
    expert_part,
    hf_tensor_names,
    is_qk_weight,
    unpermute_rows,
)

__all__ = ["GGUFFormat", "RAW_LINEAR_RE"]

# transformers names of linear weights that stay in their GGML blocks: attention
# (MLA's q_a/q_b/kv_a too; not kv_b_proj, whose dense weight MLA reads directly),
# dense and shared-expert MLPs. MoE routers stay dense (llama.cpp keeps them F32).
RAW_LINEAR_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|q_a|q_b|kv_a)_proj(_with_mqa)?"
    r"|(mlp|block_sparse_moe)\.(shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
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

    @cached_property
    def _num_experts(self) -> int:
        cfg = self._config
        return int(cfg.get("num_experts") or cfg.get("num_local_experts")
                   or cfg.get("n_routed_experts") or 0)

    def _hf_names(self, ggml_name: str) -> list[str] | None:
        layer = block_index(ggml_name)
        if layer is not None and layer >= self._config["num_hidden_layers"]:
            return None  # next-token-prediction (MTP) layers the model does not run
        return hf_tensor_names(ggml_name, self.spec, self._num_experts)

    def load_config(self) -> dict[str, Any]:
        config = dict(self._config)
        tensor_types: dict[str, str] = {}
        embedding_types: dict[str, str] = {}
        expert_types: dict[str, dict[str, str]] = {}
        for info in self.file.tensors.values():
            expert = expert_part(info.name)
            if expert is not None and self._hf_names(info.name):
                prefix = f"model.layers.{expert[0]}.{self.spec.mlp_name}.experts"
                expert_types.setdefault(prefix, {})[expert[1]] = info.qtype.name
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
            names.extend(n for n in self._hf_names(ggml_name) or () if n not in names[-1:])
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
        # Parts of split pairs (DeepSeek's k_b/v_b, gpt-oss's expert biases) until complete.
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for ggml_name, info in self.file.tensors.items():
            names = self._hf_names(ggml_name)
            if not names:
                continue
            raw = self.read_raw(ggml_name)
            if len(names) == 1 and names[0] in raw_names:
                yield names[0], raw
                continue
            expert = expert_part(ggml_name)
            if expert is not None and (
                    f"model.layers.{expert[0]}.{self.spec.mlp_name}.experts" in raw_experts):
                yield from zip(names, raw.unbind(0), strict=True)
                continue
            dense = dequantize(raw, info.qtype)
            combined = combined_target(ggml_name, self.spec)
            if combined is not None:
                hf_name, part = combined
                parts = pending.setdefault(hf_name, {})
                parts[part] = dense
                whole = combine_parts(hf_name, parts)
                if whole is not None:
                    del pending[hf_name]
                    yield hf_name, whole
            elif len(names) == 1:
                yield names[0], dense
            else:  # stacked experts [E, N, K]
                yield from zip(names, dense.unbind(0), strict=True)
        if pending:
            raise ValueError(f"{self.file.path}: incomplete split tensors "
                             f"{ {name: sorted(parts) for name, parts in pending.items()} }")

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
