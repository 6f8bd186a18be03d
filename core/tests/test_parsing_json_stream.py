"""JsonStreamer: canonical text equals json.dumps(json.loads(raw)) under any chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_engine.parsing import JsonStreamer, Reader, json_value

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=4),
    max_leaves=12,
)


def _stream(raw: str, cuts: list[int]) -> tuple[str, bool, int]:
    """Feed ``raw`` split at ``cuts`` the way a Reader does; (output, done, end index)."""
    out: list[str] = []
    streamer = JsonStreamer(out.append)
    bounds = sorted({0, len(raw), *(c % (len(raw) + 1) for c in cuts)})
    buf, i = "", 0
    for a, b in zip(bounds, bounds[1:]):
        buf += raw[a:b]
        i = streamer.feed(buf, i)
        if streamer.done or streamer.failed:
            break
    if not (streamer.done or streamer.failed):
        i = streamer.feed(buf, i, eof=True)
    return "".join(out), streamer.done, i


@settings(max_examples=300, deadline=None)
@given(_values, st.booleans(), st.sampled_from([None, 0, 2]), st.lists(st.integers(0, 10**6),
                                                                          max_size=12))
def test_canonical_text_matches_json_dumps_for_any_chunking(value, ascii_only, indent, cuts):
    raw = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    container = isinstance(value, (dict, list))
    if not container:  # scalars need a terminator to be complete
        raw += " "
    out, done, _ = _stream(raw, cuts)
    assert done
    assert out == json.dumps(json.loads(raw), ensure_ascii=False)


@pytest.mark.parametrize("raw", ['{"a": 1,}', "[1 2]", '{"a" 1}', "tru ", "01 ", '{"a": nul}',
                                 '["x\\q"]', "NaN ", '{"a": [1, 2}', "{'a': 1}"])
def test_invalid_json_fails(raw):
    out, done, _ = _stream(raw, [])
    assert not done


def test_stops_right_after_the_value():
    raw = '{"a": [1, {"b": "}"}]}</tool_call>'
    out, done, end = _stream(raw, [3, 9, 17])
    assert done and raw[end:] == "</tool_call>"
    assert out == '{"a": [1, {"b": "}"}]}'


def test_raw_control_characters_in_strings_are_accepted_and_escaped():
    out, done, _ = _stream('{"code": "a\n\tb"}', [])
    assert done and out == '{"code": "a\\n\\tb"}'


def test_surrogate_pair_escape_split_anywhere_is_one_character():
    raw = '["\\ud83d\\ude00"]'
    for cut in range(len(raw) + 1):
        assert _stream(raw, [cut])[0] == '["\U0001F600"]'
    # a lone surrogate stays an escape, so the text can always be encoded
    assert _stream('["\\ud83d x"]', [])[0] == '["\\ud83d x"]'


def test_truncated_value_fails_at_end_of_stream():
    r = Reader()
    r.push('{"a": "unfinished')
    r.eof = True
    gen = json_value(r, lambda _: None)
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value is False
