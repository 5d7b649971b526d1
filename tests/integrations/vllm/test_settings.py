"""The connector's settings and namespace identity, checked without vLLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import block_order, namespace_model_id, rank_model_ids
from kvstore.layout import KVLayout


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("capacity_bytes", -1),
        ("lookup_timeout", "nan"),
        ("lookup_timeout", 0),
        ("lookup_timeout", -2.0),
        ("store_timeout", "inf"),
        ("connect_timeout", 0),
        ("retry_interval", -1),
        ("lease_ttl", float("nan")),
        ("max_pending_save_bytes", -5),
        ("target", " "),
    ],
)
def test_a_value_out_of_range_is_refused_at_start_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=repr(key)):
        ConnectorConfig.from_extra({key: value})


def test_the_limits_themselves_are_accepted() -> None:
    config = ConnectorConfig.from_extra(
        {"retry_interval": 0, "lease_ttl": 0, "capacity_bytes": 0, "lookup_timeout": "0.05"}
    )
    assert config.lookup_timeout == 0.05


def vllm_config(**model: Any) -> Any:
    fields = {
        "model": "org/m",
        "revision": None,
        "dtype": "torch.bfloat16",
        "quantization": None,
        "hf_config": SimpleNamespace(hidden_size=8),
    }
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(**(fields | model)),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="bfloat16")


def test_everything_that_changes_the_kv_bytes_changes_the_namespace() -> None:
    base = namespace_model_id(vllm_config(), LAYOUT)
    cpu_engine = vllm_config()
    cpu_engine.device_config = SimpleNamespace(device_type="cpu")
    assert block_order(cpu_engine) == "cpu" and block_order(vllm_config()) == "canonical"
    variants = {
        "weights dtype": namespace_model_id(vllm_config(dtype="torch.float16"), LAYOUT),
        "quantization": namespace_model_id(vllm_config(quantization="fp8"), LAYOUT),
        "kv dtype": namespace_model_id(
            vllm_config(), KVLayout(2, 2, 32, block_size=32, dtype="float16")
        ),
        "block size": namespace_model_id(
            vllm_config(), KVLayout(2, 2, 32, block_size=64, dtype="bfloat16")
        ),
        "config": namespace_model_id(
            vllm_config(hf_config=SimpleNamespace(hidden_size=16)), LAYOUT
        ),
        "block order (a CPU engine's pages)": namespace_model_id(cpu_engine, LAYOUT),
    }
    assert len({base, *variants.values()}) == len(variants) + 1, variants
    assert namespace_model_id(vllm_config(), LAYOUT) == base  # deterministic


def test_each_tensor_parallel_rank_gets_its_own_namespace_and_sizes_never_mix() -> None:
    one = vllm_config()
    base = namespace_model_id(one, LAYOUT)
    assert rank_model_ids(one, base) == [base]  # TP 1: the id as before
    two, four = vllm_config(), vllm_config()
    two.parallel_config.tensor_parallel_size = 2
    four.parallel_config.tensor_parallel_size = 4
    assert namespace_model_id(two, LAYOUT) == base  # the rank split comes after
    ids_2, ids_4 = rank_model_ids(two, base), rank_model_ids(four, base)
    assert ids_2 == [f"{base}#tp-2.0", f"{base}#tp-2.1"]
    assert len(ids_4) == 4
    assert len({base, *ids_2, *ids_4}) == 7  # no two ranks or sizes share a namespace


def test_pipeline_and_context_parallel_engines_are_refused() -> None:
    config = vllm_config()
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(InvalidArgument, match="pipeline parallelism"):
        namespace_model_id(config, LAYOUT)
    config = vllm_config()
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(InvalidArgument, match="decode_context_parallel_size 2"):
        namespace_model_id(config, LAYOUT)
