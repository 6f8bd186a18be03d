"""Reader primitives: markers split across deltas are held, never leaked."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inference_engine.parsing import MarkerSet, Reader, match_after_ws, until


def _drive(gen_factory, chunks):
    r = Reader()
    gen = gen_factory(r)
    result = None
    for chunk in [*chunks, None]:
        if chunk is None:
            r.eof = True
        else:
            r.push(chunk)
        try:
            gen.send(None)
        except StopIteration as stop:
            result = stop.value
            break
    return r, result


def test_held_suffix_is_longest_partial_marker():
    markers = MarkerSet(["<tool_call>", "</think>"])
    assert markers.held("abc<tool", 0) == 5
    assert markers.held("abc</", 0) == 2
    assert markers.held("abc<", 0) == 1
    assert markers.held("abc<x", 0) == 0
    assert markers.held("<tool_call", 0) == 10
    assert markers.search("a</think>b<tool_call>", 0) == (1, "</think>")


TEXT = "a < b <tool_ c<tool_call>rest"


@given(st.lists(st.integers(0, len(TEXT)), max_size=6))
def test_until_passes_text_before_marker_for_any_chunking(cuts):
    bounds = [0, *sorted(cuts), len(TEXT)]
    chunks = [TEXT[a:b] for a, b in zip(bounds, bounds[1:])]
    seen: list[str] = []
    markers = MarkerSet(["<tool_call>"])

    def grammar(r):
        found = yield from until(r, markers, seen.append)
        return found, r.buf[r.i:]

    r, (found, _) = _drive(grammar, chunks)
    assert found == "<tool_call>"
    assert "".join(seen) == "a < b <tool_ c"
    assert all(not piece.endswith("<tool") for piece in seen[:-1] if piece)


def test_match_after_ws_consumes_nothing_on_mismatch():
    def grammar(r):
        ok = yield from match_after_ws(r, "</tool_call>")
        return ok, r.i

    _, (ok, i) = _drive(grammar, ["\n  </tool", "_call>"])
    assert ok and i == len("\n  </tool_call>")
    _, (ok, i) = _drive(grammar, ["\n  </tool", "x"])
    assert not ok and i == 0


def test_raw_log_recovers_text_after_trim():
    r = Reader()
    for piece in ["ab", "cd", "ef"]:
        r.push(piece)
    r.i = 4
    r.trim(3)  # keeps the chunk holding position 3
    assert r.raw(3, 6) == "def"
