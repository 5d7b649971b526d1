"""The vLLM connector's settings, parsed without vLLM installed."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm.config import ConnectorConfig


def test_the_default_lease_ttl_is_the_nodes() -> None:
    # A fixed 30 s would be refused by every node whose lease_ttl_max is lower.
    assert ConnectorConfig.from_extra({}).client_kwargs()["lease_ttl"] is None


def test_an_explicit_lease_ttl_is_asked_for() -> None:
    assert ConnectorConfig.from_extra({"lease_ttl": 12}).client_kwargs()["lease_ttl"] == 12.0


def test_unknown_settings_are_named() -> None:
    with pytest.raises(InvalidArgument, match="lease_tll"):
        ConnectorConfig.from_extra({"lease_tll": 5})
