"""The demo model's tools: OpenAI schemas, a JSON-schema checker, and the tools themselves.

Shared by ``train_demo_model.py`` (the corpus calls these tools), ``demo_client.py``
(validates the served model's calls and runs them) and ``tests/test_demo_model.py``.
The schema checker covers the subset of JSON Schema the tools use (``type``,
``properties``, ``required``, ``additionalProperties``, ``enum``, ``minimum``,
``maximum``, ``items``), so the demo needs no extra package.
"""

from __future__ import annotations

import datetime as dt
import json
import zlib
from typing import Any

__all__ = [
    "CITIES",
    "DEMO_PLAIN_QUESTION",
    "DEMO_TOOL_QUESTION",
    "TIMEZONE_OFFSETS",
    "TOOLS",
    "check_arguments",
    "run_tool",
    "schema_errors",
    "tool_schema",
]

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"},
            "b": {"type": "number"},
        }, "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time",
        "description": "Current time in an IANA timezone.",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "description": "e.g. Europe/Paris"},
        }, "required": ["timezone"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
        }, "required": ["query", "max_results"], "additionalProperties": False}}},
]

# The fixed demo prompts (greedy decoding must answer them well; the test checks it).
DEMO_PLAIN_QUESTION = "What is the capital of France?"
DEMO_TOOL_QUESTION = "What is the weather like in Tokyo in fahrenheit?"

# City -> IANA timezone; also the cities the weather questions use.
CITIES: dict[str, str] = {
    "Paris": "Europe/Paris", "London": "Europe/London", "Berlin": "Europe/Berlin",
    "Madrid": "Europe/Madrid", "Rome": "Europe/Rome", "Oslo": "Europe/Oslo",
    "Vienna": "Europe/Vienna", "Lisbon": "Europe/Lisbon", "Athens": "Europe/Athens",
    "Moscow": "Europe/Moscow", "Cairo": "Africa/Cairo", "Lagos": "Africa/Lagos",
    "Nairobi": "Africa/Nairobi", "Dubai": "Asia/Dubai", "Mumbai": "Asia/Kolkata",
    "Bangkok": "Asia/Bangkok", "Singapore": "Asia/Singapore", "Beijing": "Asia/Shanghai",
    "Tokyo": "Asia/Tokyo", "Seoul": "Asia/Seoul", "Sydney": "Australia/Sydney",
    "Auckland": "Pacific/Auckland", "Toronto": "America/Toronto",
    "New York": "America/New_York", "Chicago": "America/Chicago",
    "Denver": "America/Denver", "Los Angeles": "America/Los_Angeles",
    "Mexico City": "America/Mexico_City", "Lima": "America/Lima",
    "Buenos Aires": "America/Argentina/Buenos_Aires",
}

# Standard-time UTC offsets in minutes (no DST: the demo's clock is approximate).
TIMEZONE_OFFSETS: dict[str, int] = {
    "Europe/Paris": 60, "Europe/London": 0, "Europe/Berlin": 60, "Europe/Madrid": 60,
    "Europe/Rome": 60, "Europe/Oslo": 60, "Europe/Vienna": 60, "Europe/Lisbon": 0,
    "Europe/Athens": 120, "Europe/Moscow": 180, "Africa/Cairo": 120, "Africa/Lagos": 60,
    "Africa/Nairobi": 180, "Asia/Dubai": 240, "Asia/Kolkata": 330, "Asia/Bangkok": 420,
    "Asia/Singapore": 480, "Asia/Shanghai": 480, "Asia/Tokyo": 540, "Asia/Seoul": 540,
    "Australia/Sydney": 600, "Pacific/Auckland": 720, "America/Toronto": -300,
    "America/New_York": -300, "America/Chicago": -360, "America/Denver": -420,
    "America/Los_Angeles": -480, "America/Mexico_City": -360, "America/Lima": -300,
    "America/Argentina/Buenos_Aires": -180, "UTC": 0,
}

_CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def tool_schema(name: str) -> dict[str, Any]:
    """The ``parameters`` schema of tool ``name``.

    Raises:
        KeyError: no such tool.
    """
    for tool in TOOLS:
        if tool["function"]["name"] == name:
            return tool["function"]["parameters"]
    names = ", ".join(t["function"]["name"] for t in TOOLS)
    raise KeyError(f"unknown tool {name!r}; tools: {names}")


def schema_errors(schema: dict[str, Any], value: Any, path: str = "$") -> list[str]:
    """Why ``value`` breaks ``schema`` (JSON Schema subset), as messages; [] if it conforms."""
    errors: list[str] = []
    kind = schema.get("type")
    if kind is not None:
        allowed = _JSON_TYPES[kind]
        # NOTE: bool is an int subclass in Python, but not a JSON number.
        if not isinstance(value, allowed) or (isinstance(value, bool) and kind != "boolean"):
            return [f"{path}: expected {kind}, got {json.dumps(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {json.dumps(value)} is not one of {json.dumps(schema['enum'])}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required property {key!r}")
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(properties[key], item, f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: unexpected property {key!r}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def check_arguments(name: str, arguments: str) -> dict[str, Any]:
    """Parse a call's JSON ``arguments`` and check them against tool ``name``'s schema.

    Raises:
        ValueError: unknown tool, arguments that are not JSON, or that break the schema.
    """
    try:
        schema = tool_schema(name)
    except KeyError as exc:
        raise ValueError(str(exc)) from None
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise ValueError(f"{name} arguments are not JSON ({exc}): {arguments!r}") from None
    errors = schema_errors(schema, value)
    if errors:
        raise ValueError(f"{name} arguments {arguments} break the schema: {'; '.join(errors)}")
    return value


def weather(city: str, unit: str) -> dict[str, Any]:
    """A made-up but stable forecast: the same city always gets the same weather."""
    seed = zlib.crc32(city.lower().encode())
    celsius = seed % 35 - 5
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, "temperature": temperature, "unit": unit,
            "condition": _CONDITIONS[(seed >> 8) % len(_CONDITIONS)]}


def local_time(timezone: str, now: dt.datetime | None = None) -> dict[str, Any]:
    """The time in ``timezone`` (standard-time offset table; unknown zones read as UTC)."""
    now = now or dt.datetime.now(dt.UTC)
    offset = dt.timedelta(minutes=TIMEZONE_OFFSETS.get(timezone, 0))
    return {"timezone": timezone, "time": (now + offset).strftime("%H:%M")}


def search_results(query: str, max_results: int) -> dict[str, Any]:
    """Made-up result titles for ``query``."""
    titles = [f"{query} - Wikipedia", f"A short guide to {query}", f"{query}: news and facts",
              f"Everything about {query}", f"{query} explained"]
    return {"query": query, "results": titles[:max(1, min(max_results, len(titles)))]}


def add_numbers(a: float, b: float) -> dict[str, Any]:
    """``a + b``, as an int when both are ints, else rounded to 4 decimals."""
    total = a + b
    return {"result": total if isinstance(total, int) else round(total, 4)}


def run_tool(name: str, arguments: dict[str, Any], now: dt.datetime | None = None) -> str:
    """Run tool ``name`` on checked ``arguments``; the result as the JSON text sent back."""
    if name == "get_weather":
        result = weather(arguments["city"], arguments["unit"])
    elif name == "add":
        result = add_numbers(arguments["a"], arguments["b"])
    elif name == "get_time":
        result = local_time(arguments["timezone"], now)
    elif name == "search":
        result = search_results(arguments["query"], arguments["max_results"])
    else:
        raise ValueError(f"unknown tool {name!r}")
    return json.dumps(result, ensure_ascii=False)
