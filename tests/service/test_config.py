"""Configuration: flags > environment > file > defaults; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.config import Config, ConfigError, load_config
from service.config.docs import render_markdown
from service.config.schema import field_names
from service.config.values import parse_size

ROOT = Path(__file__).resolve().parents[2]


def test_defaults():
    config = load_config([], {})
    assert config == Config()
    assert config.port == 50051 and config.capacity_bytes == 1 << 30


def test_precedence_flags_over_env_over_file(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text(
        'port = 1111\nmetrics_port = 2222\ncapacity_bytes = "64MiB"\nlog_level = "debug"\n'
    )
    env = {"KVSTORE_PORT": "3333", "KVSTORE_METRICS_PORT": "4444"}
    config = load_config(["--config", str(toml), "--port", "5555"], env)
    assert config.port == 5555  # flag
    assert config.metrics_port == 4444  # env
    assert config.capacity_bytes == 64 << 20  # file
    assert config.log_level == "DEBUG"
    assert config.arena_bytes == 64 << 20  # default


def test_json_file_from_env(tmp_path):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"shared_namespaces": ["a", "b"], "salt_secret": "00" * 16}))
    config = load_config([], {"KVSTORE_CONFIG": str(path), "KVSTORE_SHARED_NAMESPACES": "c, d"})
    assert config.shared_namespaces == ("c", "d")
    assert config.salt_secret == bytes(16)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512", 512), ("64MiB", 64 << 20), ("1GiB", 1 << 30), ("512M", 512 << 20), ("2k", 2048)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--port", "http"], {}, "port (flag --port): expected an integer"),
        ([], {"KVSTORE_PORT": "70000"}, "KVSTORE_PORT"),
        ([], {"KVSTORE_CAPACITY_BYTES": "lots"}, "capacity_bytes (environment"),
        (["--capacity-bytes", "0"], {}, "must be positive"),
        (["--salt-secret", "nothex"], {}, "hex"),
        (["--salt-secret", "abcd"], {}, "at least 16 bytes"),
        (["--lease-ttl-default", "100", "--lease-ttl-max", "10"], {}, "exceeds lease_ttl_max"),
        (["--log-level", "chatty"], {}, "log_level"),
        (["--pool-prefault", "maybe"], {}, "true or false"),
        (["--config", "/nonexistent.toml"], {}, "cannot read config file"),
    ],
)
def test_bad_values(argv, env, words):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(argv, env)
    assert words in str(err.value)


def test_bad_file(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown settings"):
        load_config(["--config", str(path)], {})
    path.write_text("port = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", str(path)], {})


def test_docs_table_lists_every_field_and_is_committed():
    table = render_markdown()
    for name in field_names():
        assert f"`{name}`" in table and f"KVSTORE_{name.upper()}" in table
    assert (ROOT / "docs" / "config.md").read_text() == table, (
        "docs/config.md is stale: run python -m service.config.docs > docs/config.md"
    )


def test_a_lease_ttl_max_alone_brings_the_default_down():
    # `--lease-ttl-max 5` alone used to fail (the default 30 exceeds it); the SDK's
    # default clients ask for 0, i.e. this default.
    assert load_config(["--lease-ttl-max", "5"], {}).lease_ttl_default == 5.0
    assert load_config([], {"KVSTORE_LEASE_TTL_MAX": "120"}).lease_ttl_default == 30.0
    config = load_config(["--lease-ttl-max", "5", "--lease-ttl-default", "2"], {})
    assert (config.lease_ttl_default, config.lease_ttl_max) == (2.0, 5.0)
