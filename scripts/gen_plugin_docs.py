"""Write docs/plugins.md's hook reference from the hookspec docstrings.

Run: .venv/bin/python scripts/gen_plugin_docs.py  (a test checks the file is current)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from inference_engine import hookspecs

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "plugins.md"
BEGIN, END = "<!-- hooks:begin -->", "<!-- hooks:end -->"


def hook_reference() -> str:
    parts = []
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("ie_"):
            continue
        opts = getattr(fn, f"{hookspecs.PROJECT_NAME}_spec", {}) or {}
        kind = "decision hook (`firstresult`)" if opts.get("firstresult") else "registration hook"
        sig = str(inspect.signature(fn)).replace("'", "")
        doc = inspect.cleandoc(fn.__doc__ or "")
        parts.append(f"### `{name}{sig}`\n\n*{kind}*\n\n{doc}\n")
    return "\n".join(parts)


def render(existing: str) -> str:
    head, _, rest = existing.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{hook_reference()}\n{END}{tail}"


if __name__ == "__main__":
    text = render(DOC.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if text == DOC.read_text() else 1)
    DOC.write_text(text)
