"""Parser throughput and linearity: one character per delta through each parser pipeline.

For every tool parser of the parsers plugin, paired with its family's
reasoning parser (and every reasoning parser, paired with its family's tool
parser), plus the example plugin's ``reflect_calls`` / ``reflect``, a
realistic model output is generated in that family's format: reasoning, then
prose content interleaved with many tool calls whose arguments nest objects,
arrays, numbers, unicode and multi-line code (one argument grows with the
output, to catch work that is quadratic within a single block). The output is
streamed one character per delta through ``PipelineFactory(...).create(...)``,
at half size and at full size; a full/half time ratio near 2 means linear work.

Each streamed result is checked against ``factory.parse(text)`` (exact
strings: reasoning, content, call names and argument texts) and against the
calls that were written; any mismatch makes the exit status 1.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/parsers.py
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from inference_engine.parsing import ParseResult, PipelineFactory
from inference_engine.plugins import get_plugins

# A full/half time ratio above this is reported as not linear (2 is linear;
# the margin absorbs timer noise and cache effects on a shared machine).
NONLINEAR_RATIO = 2.6

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": "string"},
        }}}},
    {"type": "function", "function": {
        "name": "search_files",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "paths": {"type": "array"},
            "options": {"type": "object"},
        }}}},
    {"type": "function", "function": {
        "name": "write_file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"},
            "content": {"type": "string"},
            "overwrite": {"type": "boolean"},
        }}}},
    {"type": "function", "function": {
        "name": "create_event",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"},
            "attendees": {"type": "array"},
            "metadata": {"type": "object"},
            "priority": {"type": "number"},
        }}}},
]

# --------------------------------------------------------------------------- #
# Text and argument generation
# --------------------------------------------------------------------------- #

_WORDS = (
    "the user wants a forecast so I should call the tool first and then compare results "
    "with last week before answering maybe also check which files mention the config "
    "value because the build failed on line twelve where x < y && y > z was expected "
    "Oslo Zürich 東京 São Paulo naïve café résumé température 42 3.5 percent "
    "it returned an error so retry with a smaller page size then summarise"
).split()
_CITIES = ("Oslo", "Zürich", "東京", "São Paulo", "New York", "Kraków", "Reykjavík")
_MARKUP = ("a <b>bold</b> word", "x < y", "use `<div>` here", "if (a<b && c) {}",
           "see </note> above", "3 <= 4", "a <- b", "<br/>")


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(6, 18))
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_MARKUP))
    return " ".join(words).capitalize() + rng.choice((".", ".", "?", ":", "!"))


def _paragraph(rng: random.Random, num_sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(num_sentences))


def _code(rng: random.Random, num_chars: int) -> str:
    """Multi-line code with quotes, backslashes, tabs, braces and ``<``; no outer whitespace."""
    lines: list[str] = []
    size = 0
    i = 0
    while size < num_chars:
        i += 1
        line = rng.choice((
            f"def handler_{i}(request, limit={i}):",
            f'    """Serve item {i}; returns "ok" or raises."""',
            f"    if request.size < limit && flag_{i}:",
            f'\t\treturn {{"status": "ok", "id": {i}, "path": "C:\\\\tmp\\\\f{i}"}}',
            f"    html = '<div class=\"row\">' + str({i}) + '</div>'",
            f"    # naïve check {i} — should be O(n), not O(n²)",
            "",
        ))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines).strip() or "pass"


def _nested(rng: random.Random, depth: int, is_object: bool = False) -> Any:
    """A JSON-able value with objects and arrays down to ``depth`` (an object if asked)."""
    kind = 1.0 if is_object else rng.random()
    if depth <= 0 or kind < 0.3:
        return rng.choice((
            rng.randint(-10**6, 10**6), round(rng.uniform(-1e3, 1e3), 3), True, False, None,
            rng.choice(_CITIES), _sentence(rng), "quote \" and backslash \\ and tab\t",
        ))
    if kind < 0.65:
        return [_nested(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {f"k{j}_{rng.choice(_WORDS)}": _nested(rng, depth - 1)
            for j in range(rng.randint(0, 4))}


def _call(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One (tool name, arguments) pair; every argument fits its schema type."""
    name = rng.choice(("get_weather", "search_files", "write_file", "create_event"))
    if name == "get_weather":
        return name, {"city": rng.choice(_CITIES), "days": rng.randint(1, 14),
                      "units": rng.choice(("metric", "imperial"))}
    if name == "search_files":
        return name, {"query": _sentence(rng),
                      "paths": [f"src/mod_{rng.randint(0, 99)}/" for _ in range(rng.randint(1, 5))],
                      "options": {"recursive": rng.random() < 0.5,
                                  "max_results": rng.randint(1, 500),
                                  "filters": _nested(rng, 3, is_object=True)}}
    if name == "write_file":
        return name, {"path": f"pkg/file_{rng.randint(0, 999)}.py",
                      "content": _code(rng, rng.randint(200, 1500)),
                      "overwrite": rng.random() < 0.5}
    return name, {"title": _sentence(rng),
                  "attendees": [{"name": rng.choice(_CITIES), "optional": rng.random() < 0.3,
                                 "tags": [rng.choice(_WORDS) for _ in range(rng.randint(0, 3))]}
                                for _ in range(rng.randint(1, 4))],
                  "metadata": _nested(rng, 4, is_object=True),
                  "priority": round(rng.uniform(0, 10), 2)}


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _xml_value(value: Any) -> str:
    """How an XML-format model writes a typed value (typed back by the tool's schema)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return _dump(value)


# --------------------------------------------------------------------------- #
# Families: how each writes reasoning and call blocks
# --------------------------------------------------------------------------- #

Calls = list[tuple[str, dict[str, Any]]]

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


def _qwen3_block(calls: Calls) -> str:
    return "\n".join(f'<tool_call>\n{_dump({"name": n, "arguments": a})}\n</tool_call>'
                     for n, a in calls)


def _coder_block(calls: Calls) -> str:
    out = []
    for name, args in calls:
        params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n"
                         for k, v in args.items())
        out.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


def _glm_block(sep: str) -> Callable[[Calls], str]:
    def block(calls: Calls) -> str:
        out = []
        for name, args in calls:
            pairs = "".join(f"<arg_key>{k}</arg_key>{sep}"
                            f"<arg_value>{_xml_value(v)}</arg_value>{sep}"
                            for k, v in args.items())
            out.append(f"<tool_call>{name}{sep}{pairs}</tool_call>")
        return sep.join(out)
    return block


def _minimax_block(calls: Calls) -> str:
    invokes = "".join(
        f'<invoke name="{name}">\n'
        + "".join(f'<parameter name="{k}">{_xml_value(v)}</parameter>\n' for k, v in args.items())
        + "</invoke>\n"
        for name, args in calls)
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def _reflect_block(calls: Calls) -> str:
    return "\n".join(f'<call name="{n}">{_dump(a)}</call>' for n, a in calls)


def _nemotron_v2_block(calls: Calls) -> str:
    return "<TOOLCALL>" + _dump([{"name": n, "arguments": a} for n, a in calls]) + "</TOOLCALL>"


def _deepseek_block(calls: Calls) -> str:
    body = "".join(f"{DS_CALL_BEGIN}{n}{DS_SEP}{_dump(a)}{DS_CALL_END}" for n, a in calls)
    return DS_CALLS_BEGIN + body + DS_CALLS_END


@dataclass(frozen=True, slots=True)
class Family:
    """How one model family lays out an output."""

    # Text before the reasoning (the template usually opened <think> already).
    think_open: str
    # Text that closes the reasoning.
    think_close: str
    # Calls -> one call block; max_calls_per_block calls at most go in one block.
    block: Callable[[Calls], str]
    max_calls_per_block: int
    # A closing marker that a grammar looks for after optional whitespace
    # (--stress puts a long whitespace run before its last occurrence).
    lookahead_close: str
    # Separator between content and blocks.
    gap: str = "\n\n"


FAMILIES: dict[str, Family] = {
    "qwen3": Family("", "\n</think>\n\n", _qwen3_block, 3, "</tool_call>"),
    "qwen3_coder": Family("", "\n</think>\n\n", _coder_block, 2, "</tool_call>"),
    "glm45": Family("<think>", "</think>\n", _glm_block("\n"), 1, "</tool_call>"),
    "glm47": Family("", "</think>", _glm_block(""), 1, "</tool_call>", gap=""),
    "minimax_m2": Family("", "\n</think>\n\n", _minimax_block, 3, "</invoke>"),
    "nemotron_v2": Family("<think>\n", "\n</think>\n\n", _nemotron_v2_block, 3, "</TOOLCALL>"),
    "nemotron_v3": Family("", "\n</think>\n", _coder_block, 2, "</tool_call>", gap="\n"),
    "deepseek_v31": Family("", "</think>", _deepseek_block, 3, DS_CALL_END, gap=""),
    "reflect": Family("<reflect>", "</reflect>\n", _reflect_block, 3, "</call>"),
}


@dataclass(frozen=True, slots=True)
class Case:
    """One benchmarked pipeline: a tool parser, a reasoning parser, the output's family."""

    tool_parser: str
    reasoning_parser: str | None
    family: str
    enable_thinking: bool | None = None

    @property
    def label(self) -> str:
        return f"{self.tool_parser} / {self.reasoning_parser or '-'}"


# Every tool parser of the parsers plugin with its family's reasoning parser,
# plus the reasoning parsers not covered by that (docs/parsers.md, "Parsers and
# models"); cases whose parsers are not installed are skipped.
CASES = (
    Case("qwen3", "qwen3", "qwen3"),
    Case("qwen3_coder", "qwen3", "qwen3_coder"),
    Case("glm45", "glm45", "glm45"),
    Case("glm47", "glm45", "glm47"),
    Case("minimax_m2", "minimax_m2", "minimax_m2"),
    Case("minimax_m2", "minimax_m2_append_think", "minimax_m2"),
    Case("nemotron_v2", "deepseek_r1", "nemotron_v2"),
    Case("nemotron_v3", "nemotron_v3", "nemotron_v3"),
    Case("deepseek_v31", "deepseek_v3", "deepseek_v31", enable_thinking=True),
    # The example third-party plugin (examples/third-party-plugin), when installed.
    Case("reflect_calls", "reflect", "reflect"),
)


def build_output(family: Family, num_chars: int, seed: int,
                 is_stress: bool = False) -> tuple[str, Calls]:
    """A model output of about ``num_chars`` characters and the calls written in it.

    About 15% reasoning, then content paragraphs and call blocks; one
    ``write_file`` call carries code of 5% of the size, so one block grows
    with the output too. With ``is_stress`` the output ends in one more call
    whose closing marker comes after a run of newlines a quarter of the size
    long (a model stuck repeating newlines), which a waiting lookahead must
    not re-scan per delta.
    """
    rng = random.Random(seed)
    reasoning: list[str] = []
    size = 0
    while size < num_chars * 0.15:
        reasoning.append(_paragraph(rng, rng.randint(2, 6)))
        size += len(reasoning[-1]) + 2
    parts = [family.think_open + "\n\n".join(reasoning) + family.think_close]
    size = len(parts[0])
    calls: Calls = []
    big_at = num_chars // 2
    while size < num_chars:
        if rng.random() < 0.4:
            part = _paragraph(rng, rng.randint(2, 8))
        else:
            block_calls = [_call(rng) for _ in range(rng.randint(1, family.max_calls_per_block))]
            if size >= big_at:
                block_calls.insert(0, ("write_file", {"path": "pkg/big.py",
                                                      "content": _code(rng, num_chars // 20),
                                                      "overwrite": True}))
                big_at = sys.maxsize
            calls.extend(block_calls)
            part = family.block(block_calls)
        parts.append(part)
        size += len(part) + len(family.gap)
    if is_stress:
        call = ("get_weather", {"city": "Oslo", "days": 3, "units": "metric"})
        head, close, tail = family.block([call]).rpartition(family.lookahead_close)
        parts.append(head + "\n" * (num_chars // 4) + close + tail)
        calls.append(call)
    return family.gap.join(parts), calls


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #


def exact(result: ParseResult) -> tuple[Any, ...]:
    """A result with exact argument texts, ids left out."""
    return (result.reasoning, result.content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls])


def stream_per_char(factory: PipelineFactory, text: str,
                    request: dict[str, Any]) -> tuple[float, ParseResult]:
    """(seconds, result) of feeding ``text`` one character per delta."""
    pipeline = factory.create(**request)
    feed = pipeline.feed
    gc.collect()
    start = time.perf_counter()
    for ch in text:
        feed(ch)
    pipeline.finish()
    elapsed = time.perf_counter() - start
    return elapsed, pipeline.result()


def check(case: Case, mode: str, factory: PipelineFactory, text: str, calls: Calls,
          streamed: ParseResult, request: dict[str, Any]) -> list[str]:
    """Problems with one streamed result: differs from non-streaming, or lost calls."""
    problems = []
    whole = factory.parse(text, **request)
    if exact(streamed) != exact(whole):
        problems.append(f"{case.label} [{mode}, {len(text)} chars]: streamed result differs "
                        "from factory.parse(text)")
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in whole.tool_calls]
    if got != calls:
        problems.append(f"{case.label} [{mode}, {len(text)} chars]: parsed "
                        f"{len(got)} calls, {len(calls)} were written (or arguments differ)")
    return problems


@dataclass(slots=True)
class Row:
    case: Case
    mode: str
    num_chars: int
    # Characters of the half-size output (close to num_chars / 2, not exact).
    half_chars: int
    num_calls: int
    # Median seconds at half and full size.
    half_s: float
    full_s: float

    @property
    def ratio(self) -> float:
        """Full/half time, corrected to an exact doubling of the size (2.0 is linear)."""
        return 2 * (self.full_s / self.num_chars) / (self.half_s / self.half_chars)


def fmt_size(num_chars: int) -> str:
    return f"{num_chars / 1000:g}k" if num_chars % 1000 == 0 else str(num_chars)


def table(rows: list[Row], size: int) -> str:
    half = fmt_size(size // 2)
    full = fmt_size(size)
    lines = [f"| tool / reasoning parser | mode | chars | calls | chars/s | s @ {half} "
             f"| s @ {full} | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        flag = "" if row.ratio <= NONLINEAR_RATIO else " **NOT LINEAR**"
        lines.append(
            f"| {row.case.label} | {row.mode} | {row.num_chars:,} | {row.num_calls} "
            f"| {row.num_chars / row.full_s:,.0f} | {row.half_s:.3f} | {row.full_s:.3f} "
            f"| {row.ratio:.2f}{flag} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit status 1 when a streamed result differs from the non-streaming parse.")
    parser.add_argument("--size", type=int, default=200_000,
                        help="output size in characters (also timed at half this size)")
    parser.add_argument("--parsers", nargs="+", metavar="NAME",
                        help="only cases whose tool or reasoning parser has one of these names")
    parser.add_argument("--mode", choices=("incremental", "whole", "both"), default="both",
                        help="tool-call delivery mode (--tool-call-streaming)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stress", action="store_true",
                        help="end each output in a call whose closing marker follows a run "
                             "of newlines a quarter of --size long")
    args = parser.parse_args()
    if args.size < 1000:
        parser.error("--size must be at least 1000")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    registry = get_plugins().registry
    installed = set(registry.names("tool_parsers")) | set(registry.names("reasoning_parsers"))
    cases = [c for c in CASES if not args.parsers
             or {c.tool_parser, c.reasoning_parser} & set(args.parsers)]
    for case in [c for c in cases if not {c.tool_parser, c.reasoning_parser} - {None} <= installed]:
        print(f"skipped {case.label}: not installed", file=sys.stderr)
        cases.remove(case)
    if not cases:
        known = {c.tool_parser for c in CASES} | {c.reasoning_parser for c in CASES}
        parser.error(f"no installed case matches --parsers {' '.join(args.parsers or [])}; "
                     "known: " + ", ".join(sorted(name for name in known if name)))
    modes = ("incremental", "whole") if args.mode == "both" else (args.mode,)
    sizes = (args.size // 2, args.size)

    rows: list[Row] = []
    problems: list[str] = []
    progress = tqdm(total=len(cases) * len(modes) * len(sizes) * args.repeats,
                    unit="run", file=sys.stderr)
    for case in cases:
        outputs = {n: build_output(FAMILIES[case.family], n, args.seed, args.stress)
                   for n in sizes}
        request = {"tools": TOOLS, "enable_thinking": case.enable_thinking}
        for mode in modes:
            factory = PipelineFactory(case.tool_parser, case.reasoning_parser, mode)
            medians = {}
            for n in sizes:
                text, calls = outputs[n]
                times = []
                for k in range(args.repeats):
                    progress.set_description(f"{case.label} {mode} {fmt_size(n)}")
                    elapsed, streamed = stream_per_char(factory, text, request)
                    times.append(elapsed)
                    if k == 0:
                        problems += check(case, mode, factory, text, calls, streamed, request)
                    progress.update()
                medians[n] = statistics.median(times)
            text, calls = outputs[args.size]
            rows.append(Row(case, mode, len(text), len(outputs[sizes[0]][0]), len(calls),
                            medians[sizes[0]], medians[sizes[1]]))
    progress.close()

    print(table(rows, args.size))
    for problem in problems:
        print("MISMATCH:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
