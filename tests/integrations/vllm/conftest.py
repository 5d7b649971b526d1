"""Fixtures of the vLLM tests: a tiny model, a cache node and real vLLM engines.

The tests run only where a python with vLLM is found (`engines.vllm_python`);
in CI (``CI=true``) a missing vLLM is a failure, never a skip: `.ci/run`
builds the vLLM environment and exports ``KVSTORE_VLLM_PYTHON``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.engines import Node, vllm_python
from tests.integrations.vllm.models import make_llama


@pytest.fixture(scope="session")
def vllm_py() -> str:
    python = vllm_python()
    if python is None:
        message = "no python with vLLM: set KVSTORE_VLLM_PYTHON (.ci/run builds one)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (hidden 128, 4 heads of 32, 2 KV heads), float32."""
    return make_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A cache node with a 2 MiB namespace (64 blocks of the tiny model)."""
    node = Node(tmp_path_factory.mktemp("node"), namespace_capacity="2MiB").start()
    try:
        yield node
    finally:
        node.stop()
