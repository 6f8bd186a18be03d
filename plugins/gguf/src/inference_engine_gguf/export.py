"""Write a transformers model to GGUF as llama.cpp's converter (``convert_hf_to_gguf.py``) would.

For tests and benchmarks. Per-architecture differences (metadata keys, split,
transposed or renamed tensors: DeepSeek's ``attn_k_b``/``attn_v_b``, gpt-oss's
de-interleaved experts, GLM's MTP blocks, ...) are data in
:mod:`inference_engine_gguf._export_archs`; other tensor names come from the
``gguf`` package's own name map (``gguf.get_tensor_name_map``), and llama-style
q/k rows are permuted exactly as the converter does.
Quantization uses ``gguf.quants.quantize`` where the package implements it
(F16, BF16, Q4_0..Q8_0, MXFP4). For the K-quants, which the package can only
dequantize, :func:`quantize_k` is a simple min/max encoder (not llama.cpp's
error-minimising search): valid blocks, a little less accurate.

:func:`export_to_gguf` returns what the file holds, dequantized by the
``gguf`` package's numpy reference, by transformers name and in transformers
row order, so a test can load exactly those weights into the transformers model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFWriter, quants
from gguf.constants import QK_K, GGMLQuantizationType

from inference_engine_gguf._export_archs import (
    ARCH_LAYOUTS,
    DEEPSEEK2_BEFORE_KV_B_SPLIT,
    ArchLayout,
    Split,
    hparams_of,
    write_hparams,
)

__all__ = ["DEEPSEEK2_BEFORE_KV_B_SPLIT", "export_to_gguf", "llama_permute", "quantize",
           "quantize_k"]

T = GGMLQuantizationType
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.LlamaModel.permute``: rotate-half rows to interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ------------------------------------------------------------------ K-quant encoders


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b)).astype(np.float32)


def _affine_fit(x: np.ndarray, levels: int, scale_bits: int) -> tuple[Any, ...]:
    """Sub-block scales and mins for ``x [n, subs, size]`` with q in ``[0, levels]``."""
    mn = np.maximum(0.0, -x.min(axis=-1))  # [n, subs], subtracted
    scale = (x.max(axis=-1) + mn) / levels
    top = (1 << scale_bits) - 1
    d = _f16(scale.max(axis=-1, keepdims=True) / top)
    dmin = _f16(mn.max(axis=-1, keepdims=True) / top)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d32)), 0, top).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(mn, dmin32)), 0, top).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.rint(_safe_div(x + (dmin32 * m)[..., None], step))
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of the 12-byte 6-bit scale/min layout of Q4_K and Q5_K."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _pack_nibbles_k(q: np.ndarray) -> np.ndarray:
    """``q [n, 8, 32]`` (4-bit) -> 128 bytes: byte ``c*32+l`` = sub ``2c`` low, ``2c+1`` high."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """256 2-bit values -> 64 bytes: value ``c*128 + s*32 + l`` in bits ``2s`` of byte
    ``c*32+l``."""
    q = q.reshape(-1, 2, 4, 32)
    out = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for s in range(4):
        out |= (q[:, :, s] & 3) << (2 * s)
    return out.reshape(-1, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _affine_fit(x.reshape(n, 16, 16), 3, 4)
    scales = (sc & 0x0F) | (m << 4)
    return np.concatenate([scales, _pack_2bit(q), d.view(np.uint8), dmin.view(np.uint8)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 4  # q in [-4, 3]
    d = _f16(scale.max(axis=-1, keepdims=True) / 31)
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d32)), -32, 31).astype(np.int8)
    q = np.clip(np.rint(_safe_div(sub, (d32 * sc)[..., None])), -4, 3).astype(np.int8)
    u = (q + 4).astype(np.uint8).reshape(n, 256)
    hbits = u >> 2
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for s in range(8):
        hmask |= hbits[:, s * 32 : (s + 1) * 32] << s
    us = (sc.astype(np.int16) + 32).astype(np.uint8)  # 6-bit
    scales = np.zeros((n, 12), dtype=np.uint8)
    for j in range(16):
        scales[:, j % 8] |= (us[:, j] & 0x0F) << (4 * (j // 8))
        scales[:, 8 + j % 4] |= ((us[:, j] >> 4) & 0x03) << (2 * (j // 4))
    return np.concatenate([hmask, _pack_2bit(u & 3), scales, d.view(np.uint8)], axis=1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _affine_fit(x.reshape(n, 8, 32), 15, 6)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k4_scales(sc, m),
                           _pack_nibbles_k(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _affine_fit(x.reshape(n, 8, 32), 31, 6)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k4_scales(sc, m), qh,
                           _pack_nibbles_k(q & 0x0F)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 32  # q in [-32, 31]
    d = _f16(scale.max(axis=-1, keepdims=True) / 127)
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d32)), -128, 127).astype(np.int8)
    q = np.clip(np.rint(_safe_div(sub, (d32 * sc)[..., None])), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    halves = u.reshape(n, 2, 128)
    for s in range(2):  # low nibbles: value a*128 + s*64 + l -> ql[a*64 + l] nibble s
        ql |= (halves[:, :, s * 64 : (s + 1) * 64] & 0x0F) << (4 * s)
    for s in range(4):  # high 2 bits: value b*128 + s*32 + l -> qh[b*32 + l] bits 2s
        qh |= ((halves[:, :, s * 32 : (s + 1) * 32] >> 4) & 0x03) << (2 * s)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d.view(np.uint8)], axis=1)


_K_ENCODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}


def quantize_k(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows ``[..., K]`` (K a multiple of 256) -> K-quant bytes ``[..., K/256*type_size]``."""
    values = np.asarray(values, dtype=np.float32)
    lead, k = values.shape[:-1], values.shape[-1]
    if k % QK_K:
        raise ValueError(f"{qtype.name} needs rows that are multiples of {QK_K}, got {k}")
    blocks = _K_ENCODERS[qtype](values.reshape(-1, QK_K))
    return blocks.reshape(*lead, -1)


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Stored form of ``values`` in ``qtype`` (gguf's quantizer, or :func:`quantize_k`)."""
    if qtype in _K_ENCODERS:
        return quantize_k(values, qtype)
    return quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


# ------------------------------------------------------------------------- export

TypeChooser = Callable[[str, tuple[int, ...]], GGMLQuantizationType]


def export_to_gguf(model: Any, tokenizer: Any, path: str | Path,
                   qtype: GGMLQuantizationType | TypeChooser = T.F16,
                   chat_template: str | None = None,
                   extra_control_tokens: int = 0,
                   layout: ArchLayout | None = None) -> dict[str, torch.Tensor]:
    """Write ``model`` (a transformers causal LM) and its byte-level BPE ``tokenizer`` to ``path``.

    Args:
        model: a transformers model of one of :data:`ARCH_LAYOUTS`'s types (Llama,
            Qwen2, Qwen3, Qwen3-MoE, GraniteMoe, DeepSeek-V2, GLM-4-MoE, MiniMax-M2, gpt-oss).
        tokenizer: a transformers fast tokenizer with a BPE model (gpt2 style).
        path: the ``.gguf`` file to write.
        qtype: the GGML type of every 2-D (or stacked 3-D) weight, or a function of
            (transformers name, GGML tensor shape) choosing it. 1-D tensors are F32.
        chat_template: stored as ``tokenizer.chat_template`` (default: the tokenizer's).
        extra_control_tokens: filler control tokens appended to reach the model's vocab.
        layout: how the architecture is written (default: ``ARCH_LAYOUTS[model_type]``,
            what the current converter does; e.g. ``DEEPSEEK2_BEFORE_KV_B_SPLIT`` for an
            older file).

    Returns:
        transformers name -> the float32 values the file stores (dequantized
        with ``gguf.quants.dequantize``), in transformers layout.
    """
    cfg = model.config
    layout = layout or ARCH_LAYOUTS[cfg.model_type]
    hp = hparams_of(cfg)
    if layout.prepare is not None:
        layout.prepare(hp)
    num_blocks = hp.get("block_count", cfg.num_hidden_layers)
    name_map = gguf.get_tensor_name_map(layout.arch, num_blocks)
    writer = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[layout.arch])
    write_hparams(writer, layout, hp)
    file_type = _file_type(qtype)
    if file_type is not None:
        writer.add_file_type(file_type)
    _write_tokenizer(writer, tokenizer, chat_template, extra_control_tokens)
    choose = qtype if callable(qtype) else (lambda name, shape, _t=qtype: _t)

    def add(ggml_name: str, values: np.ndarray, hf_name: str) -> np.ndarray:
        """Write one GGML tensor; return what the file holds, dequantized."""
        t = choose(hf_name, values.shape) if values.ndim >= 2 else T.F32
        data = quantize(values, t) if t != T.F32 else values.astype(np.float32)
        stored = quants.dequantize(data, t).astype(np.float32)
        if layout.permutes_qk and re.search(r"\.(q|k)_proj\.(weight|bias)$", hf_name):
            heads = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            data = llama_permute(data, heads)  # rows move whole: same as permuting first
        writer.add_tensor(ggml_name, np.ascontiguousarray(data),
                          raw_dtype=t if t not in (T.F32, T.F16) else None)
        return stored

    def ggml_parts(name: str, values: np.ndarray) -> tuple[Split | None, list[tuple[str, Any]]]:
        """The GGML tensors a transformers tensor becomes (and the split that made them)."""
        match = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        split = layout.split_for(match.group(2)) if match else None
        if split is not None:
            pieces = split.split(values, hp)
            return split, [(f"blk.{match.group(1)}.{part}", piece)
                           for part, piece in zip(split.parts, pieces, strict=True)]
        ggml_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if ggml_name is None:
            raise ValueError(f"gguf has no GGML name for {name!r}")
        return None, [(ggml_name, values)]

    stored: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        split, parts = ggml_parts(name, tensor.detach().float().cpu().numpy())
        held = [add(ggml_name, values, name) for ggml_name, values in parts]
        result = split.join(held, hp) if split is not None else held[0]
        stored[name] = torch.from_numpy(np.ascontiguousarray(result, dtype=np.float32))
    for name, values in _nextn_stand_ins(model, hp):
        for ggml_name, part in ggml_parts(name, values)[1]:
            add(ggml_name, part, name)
    factors = _llama3_rope_factors(cfg)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _file_type(qtype: GGMLQuantizationType | TypeChooser) -> gguf.LlamaFileType | None:
    """``general.file_type`` for one type throughout (F32 -> ALL_F32, Q8_0 -> MOSTLY_Q8_0, ...);
    None for a mix or a type with no such name (llama.cpp then guesses it from the tensors)."""
    if callable(qtype):
        return None
    if qtype == T.F32:
        return gguf.LlamaFileType.ALL_F32
    return getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}", None)


def _nextn_stand_ins(model: Any, hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Stand-ins for GLM-4-MoE's next-token-prediction (MTP) blocks, which transformers drops.

    A released checkpoint has each as ``model.layers.L`` (``L >= num_hidden_layers``): a
    whole decoder layer plus ``eh_proj``, ``enorm``, ``hnorm``, ``embed_tokens`` and
    ``shared_head.{norm,head}``, which llama.cpp writes as ``blk.L.*`` and
    ``blk.L.nextn.*``. Layer ``L - 1``'s tensors stand in for the decoder layer and the
    model's embedding for the MTP ones; a loader must skip these blocks.
    """
    first = hp["num_hidden_layers"]
    hidden, last = hp["hidden_size"], f"model.layers.{first - 1}."
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    rng = np.random.default_rng(0)
    out: list[tuple[str, np.ndarray]] = []
    for block in range(first, hp.get("block_count", first)):
        prefix = f"model.layers.{block}."
        out += [(prefix + name[len(last):], values)
                for name, values in state.items() if name.startswith(last)]
        out += [(prefix + "eh_proj.weight",
                 rng.normal(0.0, 0.02, (hidden, 2 * hidden)).astype(np.float32)),
                (prefix + "embed_tokens.weight", embed),
                (prefix + "shared_head.head.weight", embed)]
        out += [(f"{prefix}{norm}.weight", np.ones(hidden, np.float32))
                for norm in ("enorm", "hnorm", "shared_head.norm")]
    return out


def _rope_settings(cfg: Any) -> dict[str, Any]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.update(getattr(cfg, "rope_scaling", None) or {})
    return params


def _llama3_rope_factors(cfg: Any) -> np.ndarray | None:
    """``convert_hf_to_gguf``'s ``rope_freqs`` for Llama-3 rope scaling (None otherwise)."""
    import math

    rope = _rope_settings(cfg)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = ((old_context_len / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_tokenizer(writer: GGUFWriter, tokenizer: Any, chat_template: str | None,
                     extra_control_tokens: int) -> None:
    """What ``convert_hf_to_gguf``'s ``_set_vocab_gpt2`` writes for a BPE tokenizer."""
    import json

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    added = {t.content: (i, t.special) for i, t in tokenizer.added_tokens_decoder.items()}
    size = max([*vocab.values(), *(i for i, _ in added.values())]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text, (i, special) in added.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    for j in range(extra_control_tokens):
        tokens.append(f"<|filler_{j}|>")
        types.append(gguf.TokenType.CONTROL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    for token, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id)):
        idx = getattr(tokenizer, f"{token}_token_id", None)
        if idx is not None:
            add(int(idx))
    writer.add_add_bos_token(False)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        writer.add_chat_template(template)
