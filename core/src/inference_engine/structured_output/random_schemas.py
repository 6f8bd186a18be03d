"""Random JSON schemas for property tests and the structured-output benchmark.

Every schema is bounded (strings have ``maxLength``, arrays ``maxItems``, numbers
bounds) so a grammar-constrained sample ends in few tokens even from a random model.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["random_schema"]

_WORDS = ("id", "name", "count", "ok", "tags", "score", "kind", "items", "meta", "value")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties of mixed types, nested up to depth 2."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required,
                              "additionalProperties": False}
    return schema


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "boolean", "enum", "null"]
    if depth < 3:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": _value_schema(rng, depth + 1),
                "minItems": 0, "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth)
