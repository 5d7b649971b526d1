"""The connector's settings and namespace identity, checked without vLLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import (
    KVGroup,
    block_order,
    kv_groups,
    namespace_model_id,
    tp_size,
)
from kvstore.integrations.vllm.units import engine_units
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
    full = [KVGroup(0, "full", LAYOUT, ("l0",))]
    assert [u.model_id for u in engine_units(full, base, 1)] == [base]  # TP 1: as before
    two, four = vllm_config(), vllm_config()
    two.parallel_config.tensor_parallel_size = 2
    four.parallel_config.tensor_parallel_size = 4
    assert namespace_model_id(two, LAYOUT) == base  # the rank split comes after
    assert tp_size(two) == 2
    ids_2 = [u.model_id for u in engine_units(full, base, 2)]
    ids_4 = [u.model_id for u in engine_units(full, base, 4)]
    assert ids_2 == [f"{base}#tp-2.0", f"{base}#tp-2.1"]
    assert len(ids_4) == 4
    assert len({base, *ids_2, *ids_4}) == 7  # no two ranks or sizes share a namespace


def test_each_kv_cache_group_gets_its_own_namespace_and_mla_one_for_every_rank() -> None:
    base = namespace_model_id(vllm_config(), LAYOUT)
    hybrid = [
        KVGroup(0, "sliding", LAYOUT, ("l0",), window=64),
        KVGroup(1, "sliding", LAYOUT, ("l1",), window=64),
        KVGroup(2, "full", LAYOUT, ("l2",)),
    ]
    ids = [u.model_id for u in engine_units(hybrid, base, 1)]
    assert ids == [f"{base}#g0-sliding-w64", f"{base}#g1-sliding-w64", f"{base}#g2-full"]
    units = engine_units(hybrid, base, 2)
    assert [(u.group.index, u.rank) for u in units] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    latent = KVLayout(2, 1, 576, 16, "float32", kv_order="LATENT_LAYER_TOKEN")
    mla = engine_units([KVGroup(0, "mla", latent, ("l0", "l1"))], base, 2)
    assert [(u.model_id, u.rank) for u in mla] == [(f"{base}#g0-mla#tp-2", None)]
    assert mla[0].saver == 0 and mla[0].loads_on(0) and mla[0].loads_on(1)
    assert latent.block_bytes == 2 * 16 * 576 * 4  # one latent per token and layer, no K/V


def test_pipeline_and_context_parallel_engines_are_refused() -> None:
    config = vllm_config()
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(InvalidArgument, match="pipeline parallelism"):
        namespace_model_id(config, LAYOUT)
    config = vllm_config()
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(InvalidArgument, match="decode_context_parallel_size 2"):
        namespace_model_id(config, LAYOUT)


def _spec(kind: str, **fields: Any) -> Any:
    """A stand-in for one of vLLM's KV cache specs (only its class name and fields)."""
    base = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": "torch.float32"}
    return type(kind, (), {**base, **fields})()


def _config(*specs: Any) -> Any:
    groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"layer.{i}"])
        for i, spec in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_each_kv_cache_group_is_cached_by_its_kind() -> None:
    groups = kv_groups(
        _config(
            _spec("SlidingWindowSpec", sliding_window=64),
            _spec("FullAttentionSpec", sliding_window=None),
            # vLLM's hybrid manager off: a window folded into full attention, all blocks kept
            _spec("FullAttentionSpec", sliding_window=64),
            _spec("MLAAttentionSpec", num_kv_heads=1, head_size=576),
        )
    )
    assert [(g.kind, g.window) for g in groups] == [
        ("sliding", 64),
        ("full", 0),
        ("full", 0),
        ("mla", 0),
    ]
    assert groups[3].layout.kv_order == "LATENT_LAYER_TOKEN"
    assert groups[3].layout.block_shape == (1, 1, 32, 1, 576)
    # A 64-token window at 192 computed tokens keeps blocks 4 and 5 (129 tokens skipped).
    assert groups[0].first_needed_block(192) == 4
    assert groups[1].first_needed_block(192) == 0


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (
            [_spec("FullAttentionSpec"), _spec("MambaSpec")],
            "KV cache group 1 is MambaSpec \\(Mamba or linear-attention state\\)",
        ),
        ([_spec("CrossAttentionSpec")], "its KV comes from the encoder input"),
        (
            [
                _spec("FullAttentionSpec"),
                _spec("SlidingWindowSpec", block_size=16, sliding_window=8),
            ],
            "one block size for every KV cache group; this model's groups have \\[16, 32\\]",
        ),
        ([_spec("FullAttentionSpec", head_size_v=16)], "K and V of one head size"),
        ([_spec("FullAttentionSpec", dtype="torch.float8_e4m3fnuz")], "float8_e4m3fnuz"),
        ([_spec("HiSparseHotSpec")], "does not know how vLLM keeps the blocks"),
    ],
)
def test_a_model_the_connector_cannot_cache_is_refused_with_the_real_reason(
    specs: list[Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        kv_groups(_config(*specs))
