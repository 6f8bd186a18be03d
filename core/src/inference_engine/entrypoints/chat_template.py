"""``--chat-template``: a Jinja chat template given as a file path or inline, as vLLM reads it."""

from __future__ import annotations

import codecs
from pathlib import Path

__all__ = ["load_chat_template"]

# Characters a template has and a file path has not (vLLM's rule for "inline").
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text: the file at ``value``, else ``value`` itself when it looks like
    Jinja (its backslash escapes such as ``\\n`` decoded, so a shell can pass one line).

    Raises:
        ValueError: ``value`` looks like a path but the file cannot be read.
    """
    try:
        return Path(value).read_text()
    except OSError as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it "
                             f"cannot be read: {exc.strerror or exc}") from None
    return codecs.decode(value, "unicode_escape")
