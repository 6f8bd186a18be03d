"""Test helpers for the MX / NVFP4 / ModelOpt methods: spec-formula quantizers and checkpoints.

Everything here is written straight from quant-formats.md's formulas and is
deliberately independent of the engine's codecs (:mod:`.mx_e2m1`,
:mod:`.mx_block`, :mod:`.nvfp4_codec`): tests build checkpoints with these
functions and check that the engine's loading and matmuls agree with
transformers run on the same dequantized weights. Kept in the package because
tests cannot import each other under ``--import-mode=importlib``; nothing
here is used at run time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "LINEAR_NAMES",
    "fake_quant_inputs",
    "ref_dequantized_online",
    "ref_e2m1",
    "ref_fp8_per_tensor",
    "ref_mxfp4",
    "ref_mxfp8",
    "ref_nvfp4",
    "ref_nvfp4_qdq_activation",
    "write_quantized_checkpoint",
]

# Checkpoint names of the decoder's linear layers (their ``.weight``).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def ref_e2m1(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, values float32) of ``v``: nearest E2M1 magnitude, ties to the even code.

    Saturates at 6; the sign bit is ``signbit(v)``.
    """
    mag = v.double().abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - _E2M1_GRID).abs()  # [..., 8]
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    # Among the (at most two) nearest codes prefer the even one.
    even = torch.arange(8) % 2 == 0
    even_ties = ties & even
    choice = torch.where(even_ties.any(-1), even_ties.int().argmax(-1), ties.int().argmax(-1))
    sign = torch.signbit(v)
    codes = choice.to(torch.uint8) + 8 * sign.to(torch.uint8)
    values = _E2M1_GRID[choice].float() * torch.where(sign, -1.0, 1.0)
    return codes, values


def _pack(codes: torch.Tensor) -> torch.Tensor:
    low, high = codes[..., 0::2].int(), codes[..., 1::2].int()
    return (low + 16 * high).to(torch.uint8)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(torch.log2(x.double())).long()


def ref_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss tensors of ``w [N, K]`` (K a multiple of 32): blocks [N, K/32, 16], scales, dequant.

    Scale exponent ``floor(log2(amax)) - 2`` (OCP), byte ``exponent + 127``, 0 for zero blocks.
    """
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, _floor_log2(amax.clamp(min=1e-30)) - 2,
                           torch.full_like(amax, -127, dtype=torch.long)).clamp(-127, 127)
    scale = torch.pow(2.0, exponent.double()).float().unsqueeze(-1)
    codes, values = ref_e2m1(blocks / scale)
    packed = _pack(codes.reshape(n, k)).reshape(n, k // 32, 16)
    return packed, (exponent + 127).to(torch.uint8), (values * scale).reshape(n, k)


def ref_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt MXFP8 tensors of ``w [N, K]``: weight e4m3, weight_scale U8 [N, K/32], dequant."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, _floor_log2(amax.clamp(min=1e-30)) - 8,
                           torch.full_like(amax, -127, dtype=torch.long)).clamp(-127, 127)
    scale = torch.pow(2.0, exponent.double()).float().unsqueeze(-1)
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.reshape(n, k), (exponent + 127).to(torch.uint8),
            (q.float() * scale).reshape(n, k))


def ref_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 tensors of ``w [N, K]`` (K a multiple of 16).

    Returns ``(weight U8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32, dequant)``.
    """
    n, k = w.shape
    g = global_scale if global_scale is not None else w.float().abs().max() / (6 * 448)
    g = g.float().reshape(())
    blocks = w.float().reshape(n, k // 16, 16)
    raw = blocks.abs().amax(-1) / (6 * g)
    raw = torch.where(raw == 0, torch.ones_like(raw), raw)
    b = raw.clamp(max=448).to(torch.float8_e4m3fn)
    elem_scale = (b.float() * g).unsqueeze(-1)
    codes, values = ref_e2m1(blocks / elem_scale)
    return _pack(codes.reshape(n, k)), b, g, (values * elem_scale).reshape(n, k)


def ref_nvfp4_qdq_activation(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """Activation quantize-dequantize: per 16-block ``e4m3(amax/(6*s))``, E2M1 elements."""
    shape = x.shape
    blocks = x.float().reshape(-1, shape[-1] // 16, 16)
    s = torch.tensor(input_scale, dtype=torch.float32)
    raw = blocks.abs().amax(-1) / (6 * s)
    raw = torch.where(raw == 0, torch.ones_like(raw), raw)
    b = raw.clamp(max=448).to(torch.float8_e4m3fn).float()
    elem = (b * s).unsqueeze(-1)
    _, values = ref_e2m1(torch.where(elem > 0, blocks / elem, torch.zeros_like(blocks)))
    return (values * elem).reshape(shape).to(x.dtype)


def ref_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight e4m3, weight_scale f32 scalar, dequant) with ``s = amax / 448``."""
    s = (w.float().abs().max() / 448).reshape(())
    q = (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * s


def write_quantized_checkpoint(
    src: str | Path,
    quant_dir: str | Path,
    dequant_dir: str | Path,
    quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor] | None],
    quantization_config: dict[str, Any] | None = None,
    hf_quant_config: dict[str, Any] | None = None,
) -> None:
    """Copy the model folder ``src`` twice: quantized (``quant_dir``) and its dequantized twin.

    Args:
        src: a saved transformers model folder (``model.safetensors``).
        quant_dir: receives the checkpoint in the target format.
        dequant_dir: receives the same model with every quantized weight
            replaced by its dequantized value (the reference for transformers).
        quantize: ``(module name, weight) -> ({suffix: tensor}, dequantized)``
            or None to leave the module unquantized; suffixes are appended to
            the module name (``".weight_blocks"``).
        quantization_config: written into ``quant_dir/config.json``.
        hf_quant_config: written as ``quant_dir/hf_quant_config.json``.
    """
    src, quant_dir, dequant_dir = Path(src), Path(quant_dir), Path(dequant_dir)
    for out in (quant_dir, dequant_dir):
        shutil.copytree(src, out, dirs_exist_ok=True)
        (out / "model.safetensors").unlink()
    state = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        result = None
        if leaf == "weight" and module.rpartition(".")[2] in LINEAR_NAMES:
            result = quantize(module, tensor)
        if result is None:
            quantized[name] = tensor
            dequantized[name] = tensor
            continue
        tensors, deq = result
        for suffix, t in tensors.items():
            quantized[module + suffix] = t.contiguous()
        dequantized[name] = deq.to(tensor.dtype).contiguous()
    save_file(quantized, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequant_dir / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        config_path = quant_dir / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = quantization_config
        config_path.write_text(json.dumps(config, indent=2))
    if hf_quant_config is not None:
        (quant_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))


def ref_dequantized_online(
    src: str | Path, out_dir: str | Path, dequant: Callable[[torch.Tensor], torch.Tensor],
    fuse: bool = False,
) -> None:
    """The model ``src`` with every decoder linear weight replaced by ``dequant(weight)``.

    ``fuse=True`` applies ``dequant`` to q/k/v and gate/up concatenated, as the
    engine's fused layers see them (matters for per-tensor global scales).
    """
    src, out_dir = Path(src), Path(out_dir)
    shutil.copytree(src, out_dir, dirs_exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    groups: dict[str, list[str]] = {}
    for name in state:
        module, _, leaf = name.rpartition(".")
        parent, _, short = module.rpartition(".")
        if leaf != "weight" or short not in LINEAR_NAMES:
            continue
        key = name
        if fuse and short in ("q_proj", "k_proj", "v_proj"):
            key = f"{parent}.qkv"
        elif fuse and short in ("gate_proj", "up_proj"):
            key = f"{parent}.gate_up"
        groups.setdefault(key, []).append(name)
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    for names in groups.values():
        names.sort(key=lambda n: order.get(n.rsplit(".", 2)[-2], 0))
        full = torch.cat([state[n] for n in names])
        deq = dequant(full).to(full.dtype)
        start = 0
        for n in names:
            rows = state[n].shape[0]
            state[n] = deq[start:start + rows].contiguous()
            start += rows
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def fake_quant_inputs(model: torch.nn.Module, qdq_for: Callable[[str], Callable | None]) -> list:
    """Forward pre-hooks on ``model``'s ``nn.Linear`` modules that quantize-dequantize their input.

    ``qdq_for(module name)`` returns ``x -> qdq(x)`` or None. Returns the hook handles.
    """
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            fn = qdq_for(name)
            if fn is not None:
                handles.append(module.register_forward_pre_hook(
                    lambda _m, args, fn=fn: (fn(args[0]),)))
    return handles
