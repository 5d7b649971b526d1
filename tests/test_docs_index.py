"""The docs can be found: an index of docs/, the README's links and command list (#34)."""

from __future__ import annotations

import re
from pathlib import Path

from kvstore.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()


def test_the_docs_index_lists_every_page_once_with_a_line():
    index = (DOCS / "README.md").read_text()
    rows = re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \| (.+) \|$", index, re.MULTILINE)
    listed = [name for name, _ in rows]
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert sorted(listed) == pages, "docs/README.md must list every page of docs/, once"
    assert all(len(line.split()) >= 5 for _, line in rows), "one line that says what it covers"


def test_the_readme_links_the_index_security_and_reliability():
    for page in ("docs/README.md", "docs/security.md", "docs/reliability.md"):
        assert f"]({page})" in README, page


def test_the_readmes_command_list_names_every_command():
    start = README.index("`kvstore` is the ops command")
    listed = README[start : README.index("\n\n", start)]
    commands = [c.name or c.callback.__name__ for c in app.registered_commands if c.callback]
    assert len(commands) >= 12
    for name in commands:
        assert f"`{name}" in listed, f"README's CLI list lacks `{name}`"


def test_bench_vllm_figures_live_in_benchmarks_readme_only():
    link = "benchmarks/README.md#bench_vllmpy-vllm-time-to-first-token-with-kvstore"
    row = next(line for line in README.splitlines() if line.startswith("| `bench_vllm`"))
    vllm = (DOCS / "vllm.md").read_text()
    section = vllm[vllm.index("## Benchmark\n") :]
    for text in (row, section):
        assert link in text
        assert not re.search(r"\d ms\b|\d(\.\d+)?[x\u00d7]", text), text
    assert (
        "## `bench_vllm.py`: vLLM time to first token with kvstore"
        in (ROOT / "benchmarks" / "README.md").read_text()
    )
