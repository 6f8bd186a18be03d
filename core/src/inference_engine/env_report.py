"""``inference-engine env``: what this machine and install would run, for bug reports.

Everything about the device comes from the selected
:class:`~inference_engine.interfaces.platform.Platform`; versions come from
package metadata; plugins from the plugin registry; the kernel each quant
method would use from its ``kernel_for(platform)``.
"""

from __future__ import annotations

import json
import platform as host
import sys
from dataclasses import fields
from typing import Annotated, Any, Optional

import typer

__all__ = ["collect_env", "env_command", "format_env"]

_PACKAGES = ("torch", "transformers", "triton", "safetensors", "tokenizers", "gguf",
             "pytorch-triton-xpu", "pytorch-triton-rocm")


def _version(dist: str) -> str | None:
    import importlib_metadata

    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def _default_attention_backend() -> str:
    from inference_engine.config import ModelConfig

    return next(f.default for f in fields(ModelConfig) if f.name == "attention_backend")


def collect_env(platform_name: str | None = None,
                device_ids: list[int] | None = None) -> dict[str, Any]:
    """The report as JSON-ready data (``env --json`` prints exactly this).

    Raises:
        UnknownNameError, PlatformUnavailableError, InvalidDeviceIdsError: as
            platform selection does for ``platform_name`` / ``device_ids``.
    """
    import torch

    from inference_engine import __version__
    from inference_engine.config import visible_devices_from_env
    from inference_engine.platforms.device_info import is_simulated, triton_has_backend
    from inference_engine.platforms.selection import present_platforms, select_platform
    from inference_engine.plugins import get_plugins

    plugin_set = get_plugins()
    registry = plugin_set.registry
    chosen = select_platform(platform_name, device_ids)
    present = {cls.name for cls in present_platforms()}

    registered_backends = registry.names("attention_backends")
    usable_backends = [b for b in chosen.attention_backends() if b in registered_backends]
    default_backend = _default_attention_backend()

    quant: dict[str, str] = {}
    for name in registry.names("quantization"):
        try:
            quant[name] = registry.resolve("quantization", name).kernel_for(chosen)
        except Exception as exc:  # noqa: BLE001 - report a broken method, keep going
            quant[name] = f"error: {type(exc).__name__}: {exc}"

    return {
        "inference_engine": __version__,
        "python": sys.version.split()[0],
        "os": f"{host.system()} {host.release()} ({host.machine()})",
        "versions": {
            **{name: _version(name) for name in _PACKAGES},
            "torch_cuda": torch.version.cuda,
            "torch_hip": torch.version.hip,
            "triton_backends": [b for b in ("nvidia", "amd", "intel") if triton_has_backend(b)],
        },
        "simulated_devices": is_simulated(),
        "platform": chosen.describe(),
        "platforms": [
            {"name": name, "present": name in present,
             "priority": getattr(_resolve_quietly(registry, name), "priority", None)}
            for name in registry.names("platforms")
        ],
        "visible_devices_env": dict(visible_devices_from_env(chosen.visible_devices_env_vars)),
        "attention_backend": default_backend if default_backend in usable_backends
        else (usable_backends[0] if usable_backends else None),
        "attention_backends": usable_backends,
        "quantization_kernels": quant,
        "plugins": [
            {"name": i.name, "distribution": i.distribution, "version": i.version,
             "status": i.status, "error": i.error}
            for i in plugin_set.infos
        ],
    }


def _resolve_quietly(registry: Any, name: str) -> Any:
    try:
        return registry.resolve("platforms", name)
    except Exception:  # noqa: BLE001
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def format_env(report: dict[str, Any]) -> str:
    """The report as aligned text lines."""
    p = report["platform"]
    v = report["versions"]
    lines = [
        f"inference-engine  {report['inference_engine']} (python {report['python']}, "
        f"{report['os']})",
        f"torch             {v['torch']} "
        f"(cuda {v['torch_cuda'] or '-'}, hip {v['torch_hip'] or '-'})",
        f"transformers      {v['transformers'] or 'not installed'}",
        f"triton            {v['triton'] or 'not installed'} "
        f"(backends: {', '.join(v['triton_backends']) or 'none'})",
        "",
        f"platform          {p['name']}" + ("  [SIMULATED devices]" if p["simulated"] else ""),
        "platforms         " + ", ".join(
            f"{q['name']} ({'present' if q['present'] else 'absent'})"
            for q in report["platforms"]),
    ]
    for d in p["devices"]:
        mark = "*" if d["index"] in p["selected_device_ids"] else " "
        lines.append(f"  {mark} device {d['index']}      {d['name']} "
                     f"({_gib(d['total_memory_bytes'])})")
    if report["visible_devices_env"]:
        env = ", ".join(f"{k}={val}" for k, val in report["visible_devices_env"].items())
        lines.append(f"visible devices   {env} (device ids are relative to these)")
    mem = p["memory"]
    lines += [
        f"arch              {p['arch'] or '-'}"
        + (f" (capability {p['capability'][0]}.{p['capability'][1]})" if p["capability"] else ""),
        f"memory            {_gib(mem['free_bytes'])} free of {_gib(mem['total_bytes'])}",
        f"dtypes            {', '.join(p['supported_dtypes'])}",
        f"fp8               {p['fp8_dtype'] or 'no FP8 math'}"
        + (f" (max {p['fp8_max']:g}, scale x{p['fp8_scale_adjustment']:g} for e4m3fn checkpoints)"
           if p["fp8_dtype"] else ""),
        f"fp4               {'yes' if p['fp4'] else 'no'}",
        f"triton kernels    {'yes' if p['triton'] else 'no'}",
        f"quant kernels     {', '.join(p['quant_kernels'])}",
        f"attention         {report['attention_backend']} "
        f"(usable: {', '.join(report['attention_backends'])})",
        "",
        "quantization methods (kernel on this platform):",
    ]
    lines += [f"  {name:<16}{kernel}" for name, kernel in report["quantization_kernels"].items()]
    lines += ["", "plugins:"]
    for info in report["plugins"]:
        status = "ok" if info["status"] == "ok" else f"ERROR {info['error']}"
        lines.append(f"  {info['name']:<16}{info['distribution'] or '-'} "
                     f"{info['version'] or ''}  {status}")
    return "\n".join(lines)


def env_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    platform: Annotated[Optional[str], typer.Option(  # noqa: UP045 - typer needs Optional
        help="Describe this platform instead of the one the engine would pick.")] = None,
    device_ids: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Describe these device indices (default 0).")] = None,
) -> None:
    """Show the platform, devices, capabilities, versions, plugins and kernels (for bug reports)."""
    from inference_engine.platforms.device_ids import parse_device_ids
    from inference_engine.registry import UnknownNameError

    try:
        report = collect_env(platform, parse_device_ids(device_ids))
    except (ValueError, UnknownNameError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(report, indent=2) if as_json else format_env(report))
