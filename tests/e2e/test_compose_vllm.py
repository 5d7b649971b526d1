"""docker-compose.vllm.yml wires each engine to its own node, as engines on two hosts.

The overlay adds vLLM engines (GPU images) to docker-compose.yml's Redis and
nodes; they cannot run here, so this checks what the file promises:
each engine's connector settings parse, it targets a node of the base file,
maps exactly that node's pool volume at the node's pool folder, and waits for
that node's health. tests/integrations/vllm/test_vllm_fleet.py runs the same
setup with real engines and real nodes.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from kvstore.integrations.vllm.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
OVERLAY = yaml.safe_load((ROOT / "docker-compose.vllm.yml").read_text())["services"]


def transfer_config(command: list[str]) -> dict[str, Any]:
    flag = command.index("--kv-transfer-config")
    return dict(json.loads(command[flag + 1]))


def test_each_engine_uses_its_own_node_and_pool() -> None:
    assert set(OVERLAY) == {"vllm-1", "vllm-2"}
    nodes_used = set()
    for name, engine in OVERLAY.items():
        config = transfer_config(engine["command"])
        assert config["kv_connector"] == "KVStoreConnector"
        assert config["kv_connector_module_path"] == "kvstore.integrations.vllm"
        assert config["kv_role"] == "kv_both"
        settings = ConnectorConfig.from_extra(config["kv_connector_extra_config"])
        assert settings.allow_remote  # the default: look across the cluster
        node, port = settings.target.split(":")
        assert node in BASE and port in BASE[node]["expose"], f"{name} targets {settings.target}"
        assert engine["depends_on"] == {node: {"condition": "service_healthy"}}
        shm_dir = BASE[node]["environment"]["KVSTORE_SHM_DIR"]
        pool = f"pool-{node}:{shm_dir}"  # the engine maps its node's pool, not its disk tier
        assert engine["volumes"] == [pool] and pool in BASE[node]["volumes"]
        nodes_used.add(node)
    assert nodes_used == {"node-1", "node-2"}  # two hosts, one engine each


def test_the_nodes_form_one_cluster() -> None:
    envs = [BASE[node]["environment"] for node in ("node-1", "node-2")]
    for key in ("KVSTORE_REDIS_URL", "KVSTORE_SALT_SECRET", "KVSTORE_CLUSTER_TOKEN"):
        assert envs[0][key] == envs[1][key] != ""


def test_the_engine_image_is_the_tested_vllm() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = pyproject["project"]["optional-dependencies"]["vllm"]
    version = re.fullmatch(r"vllm==([\d.]+)", pin)
    assert version is not None
    dockerfile = (ROOT / "deploy" / "vllm.Dockerfile").read_text()
    assert f"FROM vllm/vllm-openai:v{version.group(1)}\n" in dockerfile
    build = {e["build"]["dockerfile"] for e in OVERLAY.values()}
    assert build == {"deploy/vllm.Dockerfile"}
