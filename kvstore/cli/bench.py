"""``kvstore bench``: run benchmarks and tabulate their numbers.

Plain ``kvstore bench`` runs the built-in benchmarks of the core
(`kvstore.cli.microbench`) in this process: it works wherever the package is
installed, with no checkout, GPU or torch. ``kvstore bench --dir REPO
[NAMES…]`` (or NAMES alone, from a checkout) runs the repository's
``benchmarks/bench_*.py`` modules instead, each as ``python -m
benchmarks.NAME`` in its own process, each printing one JSON document;
``--quick`` is passed to modules that accept it. Either way the numbers
(nested keys flattened with dots) become rows of the table.
"""

from __future__ import annotations

import json as jsonlib
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvstore.cli import microbench
from kvstore.cli.common import (
    EXIT_NOT_CONFIGURED,
    EXIT_REFUSED,
    Json,
    column,
    console,
    fail,
    print_json,
    table,
)


def flatten(doc: Any, prefix: str = "") -> dict[str, float]:
    """Every number in ``doc`` by dotted path (``lookup.0.lookup_512_us``)."""
    out: dict[str, float] = {}
    if isinstance(doc, bool):
        return out
    if isinstance(doc, int | float):
        out[prefix] = doc
    elif isinstance(doc, dict):
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out.update(flatten(value, f"{prefix}.{i}" if prefix else str(i)))
    return out


def discover(root: Path, only: list[str]) -> list[str]:
    """Benchmark module names under ``root/benchmarks`` (``bench_core``…), sorted."""
    names = sorted(p.stem for p in (root / "benchmarks").glob("bench_*.py"))
    if only:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in only}
        missing = sorted(wanted - set(names))
        if missing:
            fail(f"no such benchmark {', '.join(missing)}; found: {', '.join(names) or 'none'}")
        names = [n for n in names if n in wanted]
    return names


def _run_one(root: Path, name: str, quick: bool, timeout: float) -> dict[str, Any]:
    args = [sys.executable, "-m", f"benchmarks.{name}"]
    if quick and "--quick" in (root / "benchmarks" / f"{name}.py").read_text():
        args.append("--quick")
    try:
        proc = subprocess.run(
            args, cwd=root, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail}"}
    try:
        doc = jsonlib.loads(proc.stdout)
    except ValueError:
        return {"ok": False, "error": "did not print one JSON document"}
    return {"ok": True, "numbers": flatten(doc), "result": doc}


def _run_builtin(name: str, quick: bool) -> dict[str, Any]:
    try:
        doc = microbench.BENCHMARKS[name](microbench.QUICK if quick else microbench.FULL)
    except Exception as exc:  # a failed benchmark is a row of the table, not a traceback
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "numbers": flatten(doc), "result": doc}


def bench(
    only: Annotated[
        list[str] | None,
        typer.Argument(help="Repository benchmarks to run (core, service…) instead of built-in."),
    ] = None,
    quick: Annotated[bool, typer.Option(help="Small sizes (for a smoke run).")] = False,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="Run the benchmarks/ of this repository checkout instead of built-in."
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds per repository benchmark.")] = 600,
    json: Json = False,
) -> None:
    """Run benchmarks (built-in core ones, or a checkout's) and print a table of their numbers."""
    root = None
    if directory is not None or only:
        root = (directory or Path(".")).resolve()
        if not (root / "benchmarks").is_dir():
            fail(
                f"no benchmarks/ in {root}: pass --dir REPO, or run `kvstore bench` alone "
                "for the built-in benchmarks",
                EXIT_NOT_CONFIGURED,
            )
    names = discover(root, only or []) if root else list(microbench.BENCHMARKS)
    results: dict[str, dict[str, Any]] = {}
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=console if not json else None, transient=json, disable=json,
    ) as progress:  # fmt: skip
        task = progress.add_task("benchmarks", total=len(names))
        for name in names:
            progress.update(task, description=f"running {name}")
            results[name] = (
                _run_one(root, name, quick, timeout) if root else _run_builtin(name, quick)
            )
            progress.advance(task)
        progress.update(task, description="done")
    failed = [n for n, r in results.items() if not r["ok"]]
    if json:
        source = str(root) if root else "built-in"
        print_json({"quick": quick, "source": source, "benchmarks": results, "failed": failed})
    else:
        t = table("benchmarks" + (" (quick)" if quick else ""))
        column(t, "benchmark")
        column(t, "metric")
        column(t, "value", number=True)
        for name, r in results.items():
            if not r["ok"]:
                t.add_row(name, f"error: {r['error']}", "-")
            for key, value in r.get("numbers", {}).items():
                t.add_row(name, key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}")
        console.print(t)
    if failed:
        raise typer.Exit(EXIT_REFUSED)


__all__ = ["bench", "flatten"]


COMMANDS = (bench,)
"""The subcommands of this module, in help order; `kvstore.cli.app` registers them."""
