"""Hand-built protobuf wire bytes (no message class): what the raw-bytes tests send."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """A protobuf base-128 varint (hand-built wire bytes, no message class)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
