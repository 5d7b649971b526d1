"""``kvstore bench``: run the repository's benchmarks and tabulate their JSON.

Each ``benchmarks/bench_*.py`` module runs as ``python -m benchmarks.NAME``
in its own process (from ``--dir``, the repository checkout), prints one
JSON document; the numbers in it (nested keys flattened with dots) become
rows of the table. ``--quick`` is passed to modules that accept it.
"""

from __future__ import annotations

import json as jsonlib
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.cli.common import EXIT_NOT_CONFIGURED, EXIT_REFUSED, Json, console, fail, print_json


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


def bench(
    only: Annotated[
        list[str] | None, typer.Argument(help="Benchmarks to run (core, service…); default all.")
    ] = None,
    quick: Annotated[bool, typer.Option(help="Small sizes (for a smoke run).")] = False,
    directory: Annotated[
        Path, typer.Option("--dir", help="Repository checkout holding benchmarks/.")
    ] = Path("."),
    timeout: Annotated[float, typer.Option(min=1, help="Seconds per benchmark.")] = 600,
    json: Json = False,
) -> None:
    """Run the benchmarks with a progress bar and print a table of their numbers."""
    root = directory.resolve()
    if not (root / "benchmarks").is_dir():
        fail(
            f"no benchmarks/ in {root}: run from a kvstore checkout or pass --dir",
            EXIT_NOT_CONFIGURED,
        )
    names = discover(root, only or [])
    results: dict[str, dict[str, Any]] = {}
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=console if not json else None, transient=json, disable=json,
    ) as progress:  # fmt: skip
        task = progress.add_task("benchmarks", total=len(names))
        for name in names:
            progress.update(task, description=f"running {name}")
            results[name] = _run_one(root, name, quick, timeout)
            progress.advance(task)
        progress.update(task, description="done")
    failed = [n for n, r in results.items() if not r["ok"]]
    if json:
        print_json({"quick": quick, "benchmarks": results, "failed": failed})
    else:
        t = Table(title="benchmarks" + (" (quick)" if quick else ""))
        for col in ("benchmark", "metric", "value"):
            t.add_column(col, justify="right" if col == "value" else "left")
        for name, r in results.items():
            if not r["ok"]:
                t.add_row(name, "error", r["error"])
            for key, value in r.get("numbers", {}).items():
                t.add_row(name, key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}")
        console.print(t)
    if failed:
        raise typer.Exit(EXIT_REFUSED)


__all__ = ["bench", "flatten"]


COMMANDS = (bench,)
"""The subcommands of this module, in help order; `kvstore.cli.app` registers them."""
