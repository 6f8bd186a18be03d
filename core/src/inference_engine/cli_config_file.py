"""``--config FILE.yaml``: a command's flags read from a YAML file, as vLLM's ``serve --config``.

Keys are flag names without the dashes (``max-num-seqs`` or ``max_num_seqs``; ``model``
is the positional argument). They become the command's defaults, so a flag given on the
command line wins over the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer

__all__ = ["ConfigFileOption", "read_config_file"]


def read_config_file(path: str) -> dict[str, Any]:
    """The file's mapping with keys as parameter names (``max-num-seqs`` -> ``max_num_seqs``).

    Raises:
        typer.BadParameter: unreadable file, bad YAML, or not a mapping of names.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--config") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise typer.BadParameter(f"{path} must hold a mapping of flag names to values "
                                 f"(e.g. 'port: 8000'), got {type(data).__name__}",
                                 param_hint="--config")
    return {key.lstrip("-").replace("-", "_"): value for key, value in data.items()}


def _apply_config_file(ctx: click.Context, param: click.Parameter,
                       value: Optional[str]) -> Optional[str]:  # noqa: UP045
    """Eager callback: put the file's values into the command's default map."""
    if value is None or ctx.resilient_parsing:
        return value
    values = read_config_file(value)
    params = {p.name: p for p in ctx.command.params if p.name and p is not param}
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise typer.BadParameter(
            f"{value}: {ctx.info_name} has no flag named {unknown[0]!r} (keys are flag names "
            f"such as max-num-seqs)", param_hint="--config")
    for name, item in values.items():
        if params[name].multiple and not isinstance(item, list):
            values[name] = [item]
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


ConfigFileOption = Annotated[Optional[str], typer.Option(  # noqa: UP045 - typer needs Optional
    "--config", is_eager=True, callback=_apply_config_file,
    help="YAML file of flags (max-num-seqs: 64, ...); flags on the command line win.")]
