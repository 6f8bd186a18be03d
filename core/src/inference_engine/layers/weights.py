"""Loading checkpoint tensors by name onto a model's (fused) parameters.

Checkpoints store ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
separately; our layers fuse them (``qkv_proj``, ``gate_up_proj``). One table,
:data:`STACKED_PARAMS`, maps each checkpoint module name to the fused module
and the part it fills, and both directions (loading, and naming what is
missing) are derived from it.

Every parameter of a fused :class:`~inference_engine.layers.linear.LinearBase`
is expected once per part (``...q_proj.weight``, ``...k_proj.weight``, ...);
quantization methods whose parameters are per part (scales) follow the same
rule. A parameter a checkpoint may legitimately lack (one computed after
loading) carries ``checkpoint_optional = True``.

A module may describe its own checkpoint names with
``checkpoint_layouts(leaf) -> list[dict[name, part id]]`` (names relative to
the module): each dict is one complete way a checkpoint can store that
parameter (MoE experts: one tensor per expert and projection, or one stacked
``[E, ...]`` tensor). The parameter is loaded when any one layout is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from inference_engine.layers.linear import LinearBase, ShardId

__all__ = ["STACKED_PARAMS", "checkpoint_layouts", "checkpoint_names", "load_checkpoint_weights"]

# Checkpoint module name -> (our fused module name, part id).
STACKED_PARAMS: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Checkpoint tensors that are never weights (transformers' saved rotary buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached")

_MAX_LISTED = 20


def checkpoint_names(
    model: nn.Module, stacked: Mapping[str, tuple[str, ShardId]] = STACKED_PARAMS
) -> dict[str, tuple[str, ShardId | None]]:
    """Every checkpoint tensor name the model expects -> (parameter name, part id or None).

    Raises:
        ValueError: for a fused layer whose module name has no checkpoint names in ``stacked``.
    """
    expected: dict[str, tuple[str, ShardId | None]] = {}
    for param_name, layouts in checkpoint_layouts(model, stacked).items():
        for layout in layouts:
            for ckpt, shard_id in layout.items():
                expected[ckpt] = (param_name, shard_id)
    return expected


def checkpoint_layouts(
    model: nn.Module, stacked: Mapping[str, tuple[str, ShardId]] = STACKED_PARAMS
) -> dict[str, list[dict[str, ShardId | None]]]:
    """Parameter name -> the alternative sets of checkpoint names that fill it.

    Raises:
        ValueError: for a fused layer whose module name has no checkpoint names in ``stacked``.
    """
    fused_to_ckpt: dict[str, dict[ShardId, str]] = {}
    for ckpt_module, (fused_module, shard_id) in stacked.items():
        fused_to_ckpt.setdefault(fused_module, {})[shard_id] = ckpt_module
    modules = dict(model.named_modules())
    result: dict[str, list[dict[str, ShardId | None]]] = {}
    for param_name, _ in model.named_parameters():
        owner_name, _, leaf = param_name.rpartition(".")
        owner = modules.get(owner_name)
        own_layouts = getattr(owner, "checkpoint_layouts", None)
        if callable(own_layouts):
            base = f"{owner_name}." if owner_name else ""
            result[param_name] = [{base + name: part for name, part in layout.items()}
                                  for layout in own_layouts(leaf)]
            continue
        if not (isinstance(owner, LinearBase) and owner.is_fused):
            result[param_name] = [{param_name: None}]
            continue
        parent, _, fused_module = owner_name.rpartition(".")
        parts = fused_to_ckpt.get(fused_module, {})
        layout: dict[str, ShardId | None] = {}
        for shard_id in owner.shard_ids:
            if shard_id not in parts:
                raise ValueError(
                    f"{owner_name}: no checkpoint name for part {shard_id!r} of fused module "
                    f"{fused_module!r}; add it to the stacked-parameter table"
                )
            ckpt = f"{parent}.{parts[shard_id]}.{leaf}" if parent else f"{parts[shard_id]}.{leaf}"
            layout[ckpt] = shard_id
        result[param_name] = [layout]
    return result


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Mapping[str, tuple[str, ShardId]] = STACKED_PARAMS,
    ignore: Callable[[str], bool] | None = None,
) -> set[str]:
    """Copy checkpoint tensors into ``model``'s parameters through their ``weight_loader``.

    Args:
        model: the model; parameter names mirror checkpoint names except fused layers.
        weights: ``(checkpoint name, tensor)`` pairs, consumed once.
        stacked: checkpoint module -> (fused module, part) table.
        ignore: names to skip silently (e.g. ``lm_head.weight`` of a tied model);
            transformers' rotary buffers are always skipped.

    Returns:
        The checkpoint names consumed (loaded or deliberately skipped).

    Raises:
        ValueError: after reading every tensor, listing all unexpected names,
            shape mismatches (parameter and both shapes) and expected names
            the checkpoint did not provide.
    """
    layouts = checkpoint_layouts(model, stacked)
    expected = checkpoint_names(model, stacked)
    scale_names = kv_scale_names(model)
    params = dict(model.named_parameters())
    consumed: set[str] = set()
    loaded: set[str] = set()
    unexpected: list[str] = []
    mismatched: dict[str, str] = {}
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (ignore is not None and ignore(name)):
            consumed.add(name)
            continue
        target = expected.get(name)
        if target is None and name in scale_names:
            for module_name, which in scale_names[name]:
                try:
                    model.get_submodule(module_name).load_kv_scale(which, tensor)
                except ValueError as exc:
                    mismatched[name] = str(exc)
            if name not in mismatched:
                consumed.add(name)
            continue
        if target is None:
            unexpected.append(name)
            continue
        param_name, shard_id = target
        param = params[param_name]
        loader = getattr(param, "weight_loader", _copy_whole)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as exc:
            mismatched[name] = str(exc)
            continue
        loaded.add(name)
        consumed.add(name)
    missing = []
    for param_name, options in layouts.items():
        if getattr(params[param_name], "checkpoint_optional", False):
            continue
        if any(all(name in loaded for name in layout) for layout in options):
            continue
        # Report against the layout the checkpoint came closest to (the first on a tie).
        closest = max(options, key=lambda layout: sum(name in loaded for name in layout))
        missing += [name for name in closest if name not in loaded and name not in mismatched]
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected)}")
    if mismatched:
        details = [f"{name}: {msg}" for name, msg in sorted(mismatched.items())]
        problems.append(f"{len(mismatched)} shape mismatch(es): {_listing(details, sort=False)}")
    if missing:
        problems.append(
            f"{len(missing)} tensor(s) missing from the checkpoint: {_listing(missing)}"
        )
    if problems:
        raise ValueError(f"checkpoint does not fit {type(model).__name__}: " + "; ".join(problems))
    return consumed


def kv_scale_names(model: nn.Module) -> dict[str, list[tuple[str, str]]]:
    """Checkpoint names of KV-cache scales -> (module, ``k_scale``/``v_scale``) they set.

    A module declaring ``checkpoint_kv_scales`` and ``load_kv_scale`` (the attention layer)
    answers to those names relative to its parent (``...self_attn.k_scale`` for
    ``...self_attn.attn``).
    """
    result: dict[str, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules():
        table = getattr(module, "checkpoint_kv_scales", None)
        if not table or not module_name:
            continue
        parent = module_name.rpartition(".")[0]
        for suffix, targets in table.items():
            name = f"{parent}.{suffix}" if parent else suffix
            result.setdefault(name, []).extend((module_name, t) for t in targets)
    return result


def _copy_whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: the checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def _listing(items: list[str], sort: bool = True) -> str:
    items = sorted(items) if sort else items
    shown = ", ".join(items[:_MAX_LISTED])
    if len(items) > _MAX_LISTED:
        shown += f", ... and {len(items) - _MAX_LISTED} more"
    return f"[{shown}]"
