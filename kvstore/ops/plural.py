"""Counted nouns for the lines people read: ``1 block``, ``2 blocks``, ``0 blocks``.

The CLI's tables and messages and the node's log lines count things in
f-strings; a bare ``f"{n} blocks"`` reads "1 blocks". One helper, so every
count reads right and nobody re-derives the rule.
"""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``count`` and ``noun``, the noun plural unless ``count`` is exactly 1.

    Args:
        count: how many.
        noun: the singular (``"block"``).
        many: the plural when it is not ``noun + "s"`` (``"entries"``).

    >>> plural(1, "block"), plural(2, "block"), plural(0, "entry", "entries")
    ('1 block', '2 blocks', '0 entries')
    """
    return f"{count} {noun if count == 1 else many or noun + 's'}"


__all__ = ["plural"]
