"""The wire format and the settings, without sockets: both encodings, bad input, parsing."""

from __future__ import annotations

import subprocess
import sys
from array import array
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest

from service.config import ConfigError, load_config
from service.config.engines import EngineSource
from service.node import Node
from service.vllm_events import wire
from service.vllm_events.wire import Cleared, Removed, Stored, WireError, decode_batch

ROOT = Path(__file__).resolve().parents[2]
H = bytes(range(32))


def test_published_batches_decode_in_both_encodings() -> None:
    for as_array in (False, True):
        events = [
            wire.stored([H], None, 16, "CPU_kvstore", array=as_array),
            wire.removed([H], "m", array=as_array),
        ]
        batch = decode_batch(wire.encode_batch(2.5, events))
        assert batch.ts == 2.5 and batch.data_parallel_rank is None
        first, second = batch.events
        assert first == Stored((H,), None, array("I"), 16, "CPU_kvstore", None, None, None)
        assert second == Removed((H,), "m", None)


def test_map_batches_int_hashes_and_old_short_arrays() -> None:
    payload = msgpack.packb(
        {
            "ts": 1,
            "events": [
                ["BlockStored", [7, 8], 6, [1, 2, 3, 4, 5, 6, 7, 8], 4, None],
                ["AllBlocksCleared"],
            ],
            "data_parallel_rank": 1,
        }
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 1
    stored, cleared = batch.events
    assert isinstance(stored, Stored) and stored.block_hashes == (7, 8) and stored.parent == 6
    assert stored.medium is None  # an old publisher without the field
    assert cleared == Cleared()


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb("text"),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [5]]),
        msgpack.packb([1.0, [{"type": 3}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [True]}]]),
        msgpack.packb([1.0, [["BlockStored", [b"h"], None, ["x"], 4]]]),
        msgpack.packb([1.0, [["BlockStored", [b"h"], None, [1], 0]]]),
        msgpack.packb([1.0, [["BlockRemoved", b"h", None]]]),
        msgpack.packb([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_unknown_event_types_are_skipped() -> None:
    batch = decode_batch(msgpack.packb([1.0, [{"type": "Future"}, ["Future", 1]]]))
    assert batch.events == ()


def test_engine_sources_parse_from_json_and_refuse_mistakes() -> None:
    text = '[{"name": "e-1", "endpoint": "tcp://h:5557", "model_id": "m", "tenant": "t"}]'
    (source,) = load_config([], {"KVSTORE_ENGINE_KV_EVENTS": text}).engine_kv_events
    assert (source.name, source.endpoint, source.model_id, source.tenant) == (
        "e-1",
        "tcp://h:5557",
        "m",
        "t",
    )
    for bad, why in [
        ('{"name": "e"}', "list"),
        ('[{"name": "a b", "endpoint": "x", "model_id": "m"}]', "name"),
        ('[{"name": "e", "model_id": "m"}]', "endpoint"),
        ('[{"name": "e", "endpoint": "x", "model_id": "m", "port": 1}]', "unknown"),
        (
            '[{"name": "e", "endpoint": "x", "model_id": "m"}, '
            '{"name": "e", "endpoint": "y", "model_id": "m"}]',
            "unique",
        ),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config([], {"KVSTORE_ENGINE_KV_EVENTS": bad})
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        load_config(["--kv-events-replay-endpoint", "tcp://*:1"], {})
    with pytest.raises(ConfigError, match="map"):
        load_config(["--kv-events-encoding", "cbor"], {})


WITHOUT_EXTRA = r"""
import sys
sys.modules["zmq"] = None
sys.modules["msgpack"] = None
from dataclasses import replace
from kvstore.extras import MissingExtra
from service.config import Config
from service.node import Node
config = Config(port=0, metrics_port=0, shm_dir=sys.argv[1], salt_secret=b"s" * 32, node_id="x")
node = Node(config)
node.kv_events.start()  # nothing configured: nothing imported
try:
    Node(replace(config, kv_events_endpoint="tcp://127.0.0.1:*")).kv_events.start()
except MissingExtra as exc:
    print("missing:", exc)
"""


def test_the_node_runs_without_the_extra(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert "pip install 'kvstore[events]'" in out.stdout


async def test_endpoints_that_cannot_be_used_name_the_setting(server_config) -> None:
    node = Node(replace(server_config, kv_events_endpoint="nonsense"))
    with pytest.raises(ConfigError, match="kv_events_endpoint 'nonsense'"):
        node.kv_events.start()
    source = EngineSource(name="e1", endpoint="nowhere", model_id="m")
    node = Node(replace(server_config, engine_kv_events=(source,)))
    try:
        with pytest.raises(ConfigError, match="engine_kv_events e1: endpoint 'nowhere'"):
            node.kv_events.start()
    finally:
        await node.kv_events.stop()
