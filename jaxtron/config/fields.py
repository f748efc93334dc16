"""How a config field is declared: its default and the one-paragraph doc that ``--help``, docs/config.md and
the schema's readers print (kept in the dataclass field's metadata under ``doc``)."""

from __future__ import annotations

import dataclasses
from typing import Any


def documented(default: Any = dataclasses.MISSING, doc: str = "", factory: Any = None):
    """A dataclass field with ``default`` (or ``factory`` for a mutable default) and its ``doc``."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})
