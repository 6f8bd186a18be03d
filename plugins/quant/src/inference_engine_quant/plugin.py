"""Registrations of inference-engine-quant; targets stay strings until used.

Nothing is registered until the code behind a name exists and works.
"""

from __future__ import annotations

from inference_engine import hookimpl  # noqa: F401 - used as registrations land
