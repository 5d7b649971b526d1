"""The node's web page and JSON endpoints, and the page in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest

from tests.cli.conftest import populate, start_node, stop_node, store_prompt
from tests.waiting import wait_until

QUIET_MODEL = "quiet-model"
"""A namespace registered before the busy one, with one block and no lookups."""


def add_quiet_namespace(node) -> str:
    return store_prompt(node, QUIET_MODEL, list(range(4)), (("x-kvstore-tenant", "bob"),))


@pytest.fixture(scope="module")
def web_node(tmp_path_factory):
    node = start_node(tmp_path_factory.mktemp("web-pools"))
    try:
        quiet = add_quiet_namespace(node)
        populate(node)
        node.extra["quiet"] = quiet
        yield node
    finally:
        stop_node(node)


def get(node, path: str) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{node.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for_samples(node, n: int) -> dict:
    return wait_until(
        lambda: json.loads(get(node, "/api/stats")[1]),
        ok=lambda doc: len(doc["history"]) >= n,
        within=10,
        interval=0.1,
        what=f"{n} samples in /api/stats history",
    )


def test_api_stats_and_history(web_node):
    doc = wait_for_samples(web_node, 2)
    assert doc["node_id"] == "cli-node" and doc["used_blocks"] == 11
    assert len(doc["history"]) >= 2
    last = doc["history"][-1]
    assert last["hit_tokens"] == 64 and last["miss_tokens"] == 8 and last["used_blocks"] == 11
    rows = {(t["namespace"], t["tenant"]) for t in doc["tenants"]}
    assert rows == {(web_node.namespace, "default"), (web_node.extra["quiet"], "bob")}


def test_api_tree(web_node):
    status, body = get(web_node, "/api/tree")  # no namespace: the busiest, not the first
    doc = json.loads(body)
    assert status == 200 and doc["namespace"] == web_node.namespace
    assert doc["runs"] == 5 and doc["roots"][0]["requests"] == 3
    assert doc["namespaces"] == [web_node.extra["quiet"], web_node.namespace]
    quiet = json.loads(get(web_node, f"/api/tree?namespace={web_node.extra['quiet']}")[1])
    assert quiet["runs"] == 1 and quiet["roots"][0]["tenant"] == "bob"
    # A model id, or a unique prefix of one, names the namespace too (kvstore.ops.names).
    for name in (QUIET_MODEL, "quiet-m"):
        by_model = json.loads(get(web_node, f"/api/tree?namespace={name}")[1])
        assert by_model["namespace"] == web_node.extra["quiet"], name
    assert json.loads(get(web_node, "/api/tree?namespace=demo-model")[1])["namespace"] == (
        web_node.namespace
    )
    status, body = get(web_node, "/api/tree?namespace=nope")
    assert status == 404 and "nope" in json.loads(body)["error"]
    assert get(web_node, "/api/nothing")[0] == 404
    assert get(web_node, "/nothing")[0] == 404


def test_metrics_still_served_and_named_by_convention(web_node):
    status, body = get(web_node, "/metrics")
    assert status == 200
    text = body.decode()
    for name in ("kvstore_lookup_tokens_total", "kvstore_lookup_blocks_total",
                 "kvstore_evictions_total", "kvstore_lease_expiries_total",
                 "kvstore_rpc_duration_seconds", "kvstore_rpc_errors_total",
                 "kvstore_blocks", "kvstore_capacity_blocks", "kvstore_leases",
                 "kvstore_lease_pins", "kvstore_node_capacity_bytes",
                 "kvstore_node_allocated_bytes", "kvstore_node_uptime_seconds",
                 "kvstore_node_huge_page_bytes"):  # fmt: skip
        assert f"# HELP {name} " in text, name
    counters = [line.split()[2] for line in text.splitlines() if line.endswith(" counter")]
    assert counters and all(name.endswith("_total") for name in counters), counters


def png_is_drawn(path: Path) -> bool:
    """Whether a PNG has real content: many distinct byte values in its pixel data."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    pixels = zlib.decompress(idat)
    return len(set(pixels)) > 32


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--virtual-time-budget=5000", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_page_renders_live_data_in_chromium(web_node, tmp_path):
    wait_for_samples(web_node, 2)
    url = f"http://127.0.0.1:{web_node.metrics_port}/"
    dom = chromium("--dump-dom", "--window-size=1400,1100", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-rendered="1"' in html, html[-3000:]
    assert "cli-node" in html and "88.9%" in html
    assert html.count('class="run"') == 5  # the tree's five runs as SVG groups
    assert "12 tok \u00d73" in html  # the shared system prompt, drawn with its label
    assert 'class="occ-pinned"' in html and 'id="hit-line"' in html
    shot = tmp_path / "page.png"
    r = chromium(f"--screenshot={shot}", "--window-size=1000,1100", url)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    assert png_is_drawn(shot)


def test_page_groups_namespaces_by_model_and_opens_the_busiest(web_node):
    wait_for_samples(web_node, 2)
    url = f"http://127.0.0.1:{web_node.metrics_port}/"
    html = chromium("--dump-dom", "--window-size=1400,1100", url).stdout
    assert 'data-rendered="1"' in html, html[-3000:]
    # One heading per model, the busy one first, each namespace with its tenants.
    models = re.findall(r'<h3 class="model">([^<]*)</h3>', html)
    assert models == ["demo-model", QUIET_MODEL]
    sections = re.findall(r'<div class="ns[^"]*" data-namespace="([0-9a-f]+)"', html)
    assert sections == [web_node.namespace, web_node.extra["quiet"]]
    busy, quiet = html.split(f'data-namespace="{web_node.extra["quiet"]}"')
    assert "<td>default</td>" in busy and "<td>bob</td>" in quiet
    # The tree opens on the busiest namespace, not the first registered one.
    assert f'data-namespace="{web_node.namespace}"' in html.split('class="ns selected"')[1][:80]
    picked = re.search(r'<option value="([0-9a-f]+)" selected="">', html)
    assert picked is not None and picked.group(1) == web_node.namespace
    assert re.search(r'<optgroup label="demo-model">', html)


def test_hit_rate_chart_has_a_time_axis_a_full_legend_and_full_width(web_node):
    wait_for_samples(web_node, 12)  # over 2 s of samples: at least two 1 s ticks
    url = f"http://127.0.0.1:{web_node.metrics_port}/"
    html = chromium("--dump-dom", "--window-size=1400,1100", url).stdout
    assert 'data-rendered="1"' in html, html[-3000:]
    ticks = re.findall(r'class="tick">(\d\d:\d\d:\d\d)</text>', html)
    assert len(ticks) >= 2 and ticks == sorted(set(ticks)), ticks  # distinct, in order
    # The legend is HTML above the chart (wraps, never clipped by the SVG).
    legend = html.split('id="history-legend"')[1].split("</div>")[0]
    assert "hit rate" in legend and "occupancy" in legend
    # Every chart spans the window (1400 px less the body margins), not a fixed 900 px.
    for svg in ("history", "tree"):
        match = re.search(rf'<svg id="{svg}"[^>]* width="(\d+)"', html)
        assert match is not None and int(match.group(1)) >= 1300, (svg, match)


def test_grafana_dashboard_uses_only_exported_metrics(web_node):
    import re

    text = get(web_node, "/metrics")[1].decode()
    exported = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    exported |= {f"{n}_bucket" for n in exported} | {f"{n}_total" for n in exported}
    doc = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    used = {
        name
        for panel in doc["panels"]
        for target in panel["targets"]
        for name in re.findall(r"kvstore_[a-z_]+", target["expr"])
    }
    assert used and used <= exported, used - exported
