"""The disk tier's storage engine: fixed-size slots in one preallocated file.

`DiskTier` is the whole public surface (docs/disk.md for the node's side);
the on-disk format is `format`, the pure index `index`, the file and its
aligned buffers `io`.
"""

from __future__ import annotations

from service.disk.format import DiskKey
from service.disk.io import DiskTierError
from service.disk.stats import DiskEvent, DiskEventKind, DiskStats
from service.disk.tier import DiskTier

__all__ = ["DiskEvent", "DiskEventKind", "DiskKey", "DiskStats", "DiskTier", "DiskTierError"]
