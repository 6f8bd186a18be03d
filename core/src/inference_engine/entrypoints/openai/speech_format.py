"""Whisper output as the transcription API returns it: timestamp segments, SRT and WebVTT."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Segment", "parse_segments", "to_srt", "to_vtt"]

# Seconds per timestamp token step (<|0.00|>, <|0.02|>, ...).
TIMESTAMP_STEP = 0.02


@dataclass
class Segment:
    """A stretch of text with its start and end in the whole upload, in seconds."""

    start: float
    end: float
    text: str
    # Its text tokens (timestamp tokens excluded).
    tokens: list[int]
    # Sample offset of its 30 s window, in feature frames x hop (``seek`` as OpenAI has it).
    seek: int


def parse_segments(token_ids: list[int], timestamp_begin: int, eos_ids: set[int],
                   offset: float, window_end: float, seek: int, decode: Any) -> list[Segment]:
    """Cut one window's output at its timestamp tokens (``<|t0|> text <|t1|>``).

    Text after the last timestamp, or a window with none at all, ends at ``window_end``.

    Args:
        token_ids: the generated tokens of the window.
        timestamp_begin: id of ``<|0.00|>``; every id from it up is a timestamp.
        eos_ids: end tokens, dropped.
        offset: the window's start in the upload (seconds).
        window_end: the window's end in the upload (seconds).
        seek: the window's ``seek`` value.
        decode: token ids -> text.
    """
    segments: list[Segment] = []
    start: float | None = None
    pending: list[int] = []
    for token in token_ids:
        if token in eos_ids:
            continue
        if token >= timestamp_begin:
            time = offset + (token - timestamp_begin) * TIMESTAMP_STEP
            if pending:
                segments.append(Segment(offset if start is None else start, time,
                                        decode(pending), pending, seek))
                pending, start = [], None
            else:
                start = time
        else:
            pending.append(token)
    if pending:
        segments.append(Segment(offset if start is None else start, window_end,
                                decode(pending), pending, seek))
    return segments


def _clock(seconds: float, decimal: str) -> str:
    millis = int(round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def to_srt(segments: list[Segment]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``."""
    cues = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate(segments, 1)]
    return "\n".join(cues)


def to_vtt(segments: list[Segment]) -> str:
    """WebVTT: a ``WEBVTT`` header, cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``."""
    cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n"
            for s in segments]
    return "WEBVTT\n\n" + "\n".join(cues)
