"""Stop strings: matches across token boundaries, earliest wins, hold-back for streams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_engine.detokenizer import (
    StopChecker,
    find_stop,
    find_stop_string,
    stop_holdback,
)


def run_stream(chunks: list[str], stops: list[str], include: bool = False):
    """Feed text chunks like detokenizer deltas; return (final text, streamed text, stop)."""
    checker = StopChecker(stops, include)
    text, streamed = "", ""
    for chunk in chunks:
        text += chunk
        match = checker.check(text, len(chunk))
        if match is not None:
            assert match.text.startswith(streamed)
            return match.text, streamed, match.stop
        safe = text[: checker.streamable_len(text)]
        assert safe.startswith(streamed)
        streamed = safe
    return text, streamed, None


def test_stop_spanning_token_boundaries_is_found():
    final, streamed, stop = run_stream(["Hel", "lo #", "#", "# world"], ["###"])
    assert (final, stop) == ("Hello ", "###")
    assert streamed == "Hello "


def test_stop_at_the_very_start_gives_empty_text():
    assert run_stream(["</s>more"], ["</s>"])[0] == ""
    assert run_stream(["<", "/s", ">"], ["</s>"])[:2] == ("", "")
    assert run_stream(["</s>"], ["</s>"], include=True)[0] == "</s>"


def test_earliest_of_several_stop_strings_wins():
    final, _, stop = run_stream(["one two ", "three END four STOP"], ["STOP", "END", "two"])
    assert (final, stop) == ("one ", "two")
    match = find_stop_string("xx END yy STOP", 14, ["STOP", "END"])
    assert (match.text, match.stop, match.start) == ("xx ", "END", 3)


def test_equal_starts_prefer_the_shorter_stop():
    match = find_stop_string("a<|end|>", 8, ["<|end|>", "<|"], include_stop_str_in_output=True)
    assert (match.text, match.stop) == ("a<|", "<|")


def test_include_stop_str_in_output_keeps_the_stop():
    final, _, _ = run_stream(["answer: 4", "2.\n\nQ", ":"], ["\n\nQ:"], include=True)
    assert final == "answer: 42.\n\nQ:"


def test_only_the_tail_is_searched():
    # "STOP" sits wholly in already-checked text: not a new match.
    assert find_stop_string("a STOP b", 2, ["STOP"]) is None
    # A match ending one character into the new text is found.
    assert find_stop_string("a STOP", 1, ["STOP"]).text == "a "
    assert find_stop_string("abc", 0, ["abc"]) is None


def test_older_find_stop_form_agrees():
    assert find_stop("hello ### x", 6, ["###"]) == ("hello ", "###")
    assert find_stop("hello ### x", 6, ["###"], include=True) == ("hello ###", "###")
    assert find_stop("hello", 0, ["###"]) is None


@pytest.mark.parametrize(
    "text, stops, hold",
    [
        ("Hello #", ["###"], 1),
        ("Hello ##", ["###"], 2),
        ("Hello ###x", ["###"], 0),
        ("Hello", ["###"], 0),
        ("Hello", ["x"], 0),
        ("a </", ["</s>", "<|im_end|>"], 2),
        ("a <|im", ["</s>", "<|im_end|>"], 4),
        ("ab", ["abc"], 2),
        ("", ["abc"], 0),
    ],
)
def test_holdback_is_the_longest_tail_that_starts_a_stop(text, stops, hold):
    assert stop_holdback(text, stops) == hold
    assert StopChecker(stops).holdback(text) == hold


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])


def brute_force_stop(chunks: list[str], stops: list[str]) -> str:
    """Earliest-starting match among those ending in each new chunk, by full search."""
    text = ""
    for chunk in chunks:
        old = len(text)
        text += chunk
        hits = [(i, len(s)) for s in stops for i in range(len(text))
                if text.startswith(s, i) and i + len(s) > old]
        if hits:
            return text[: min(hits)[0]]
    return text


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab#<>", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab#<>", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streams_match_brute_force_and_never_leak_partial_stops(chunks, stops):
    final, streamed, _ = run_stream(chunks, stops)
    assert final == brute_force_stop(chunks, stops)
    assert final.startswith(streamed)

