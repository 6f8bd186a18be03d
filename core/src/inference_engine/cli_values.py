"""Parsers for option values several commands take (``generate``, ``serve``, ``bench``)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["model_config_overrides", "parse_key_values"]

INDEXER_DTYPES = ("auto", "fp8", "model")


def parse_key_values(values: list[str] | None, flag: str) -> dict[str, str]:
    """Repeated ``KEY=VALUE`` option values as a dict.

    Raises:
        ValueError: for a value without ``=`` or with an empty key.
    """
    parsed: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        parsed[key.strip()] = value.strip()
    return parsed


def model_config_overrides(hf_overrides: str | None, indexer_dtype: str | None) -> dict[str, Any]:
    """``--hf-overrides`` (a JSON object of config.json keys) with ``--indexer-dtype`` added.

    Raises:
        ValueError: naming the flag, for text that is not a JSON object or an unknown dtype.
    """
    overrides: dict[str, Any] = {}
    if hf_overrides:
        try:
            overrides = json.loads(hf_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is not valid JSON: {exc}") from None
        if not isinstance(overrides, dict):
            raise ValueError(f"--hf-overrides must be a JSON object, got {hf_overrides!r}")
    if indexer_dtype is not None:
        if indexer_dtype not in INDEXER_DTYPES:
            raise ValueError(f"--indexer-dtype must be one of {', '.join(INDEXER_DTYPES)}, "
                             f"got {indexer_dtype!r}")
        overrides["indexer_dtype"] = indexer_dtype
    return overrides
