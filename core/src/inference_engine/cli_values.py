"""Parsers for option values several commands take (``generate``, ``serve``, ``bench``)."""

from __future__ import annotations

__all__ = ["parse_key_values"]


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
