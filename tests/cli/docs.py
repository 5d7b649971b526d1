"""What the docs say, read by the tests that keep the CLI and its docs in step."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def text(name: str) -> str:
    """A doc page with its whitespace collapsed (quotes may wrap across lines)."""
    return " ".join((DOCS / name).read_text().split())


def documented_node_fields() -> list[str]:
    """The fields the `kvstore nodes` row of the command table lists for ``--json``."""
    row = next(
        line for line in (DOCS / "operations.md").read_text().splitlines()
        if line.startswith("| `kvstore nodes")
    )  # fmt: skip
    shape = row.split("|")[3]
    [fields] = re.findall(r"`([a-z_, ]+)`", shape)
    return [f.strip() for f in fields.split(",")]
