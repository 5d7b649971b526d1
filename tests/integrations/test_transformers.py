"""A transformers Llama reusing KV from a real cache node gets exactly the logits of a
full recompute; other system prompts, tenants and models get no reuse.

The model is a tiny Llama with seeded random weights built from a config (no
downloads), float32 on CPU. Multi-process tests run `tests.integrations.runner`
as separate runner processes against a `python -m service` node.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

from kvstore.client import SyncClient
from kvstore.errors import AlreadyExists, InvalidArgument
from kvstore.integrations.transformers import (
    CachedPrefill,
    blocks_to_cache,
    cache_argument,
    cache_block,
    config_fingerprint,
    kv_layout_for,
    weights_fingerprint,
)
from tests.integrations.runner import BLOCK_SIZE, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
ATOL = RTOL = 1e-5
"""Tight float32 tolerance: a reused prefix must not change the logits beyond rounding."""

pytestmark = pytest.mark.e2e


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


SYSTEM_A = tokens(1, 100)  # 6 full blocks of 16 and 4 tokens into the 7th
SYSTEM_B = tokens(2, 100)
USER_1, USER_2 = tokens(11, 40), tokens(12, 37)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=0)


def full_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0]


@pytest.fixture
def kv(kv_target: str, request: pytest.FixtureRequest) -> Iterator[SyncClient]:
    # One tenant per test: tests never see each other's blocks.
    with SyncClient(kv_target, tenant=f"t-{request.node.name[:40]}".replace("[", "-")) as client:
        yield client


def run_runners(target: str, tmp_path: Path, *runs: tuple[list[int], list[str]]) -> list[dict]:
    """Runner processes, started together (one torch thread each): each prefills its prompt.

    Returns each one's JSON summary, plus its ``logits`` when it ran.
    """
    procs = []
    for prompt, args in runs:
        prompt_file = tmp_path / f"prompt-{len(list(tmp_path.iterdir()))}.json"
        prompt_file.write_text(json.dumps(prompt))
        out = prompt_file.with_suffix(".pt")
        cmd = [sys.executable, "-m", "tests.integrations.runner", "--target", target]
        cmd += ["--prompt-file", str(prompt_file), "--out", str(out), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=PIPE, stderr=PIPE, text=True)
        procs.append((proc, out))
    summaries = []
    for proc, out in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode in (0, 3), stderr
        summary: dict = json.loads(stdout.strip().splitlines()[-1])
        if proc.returncode == 0:
            summary["logits"] = torch.load(out)
        summaries.append(summary)
    return summaries


# --- in this process -----------------------------------------------------------------


def test_layout_and_fingerprints_follow_the_model(model) -> None:
    layout = kv_layout_for(model.config, block_size=BLOCK_SIZE, dtype=model.dtype)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.dtype == "float32"
    assert config_fingerprint(model.config) == config_fingerprint(tiny_llama(seed=1).config)
    assert config_fingerprint(model.config) != config_fingerprint(tiny_llama(layers=3).config)
    assert weights_fingerprint(model) == weights_fingerprint(tiny_llama(seed=0))
    assert weights_fingerprint(model) != weights_fingerprint(tiny_llama(seed=1))
    with pytest.raises(InvalidArgument):
        kv_layout_for(model.config, block_size=BLOCK_SIZE, dtype=torch.float64)


def test_blocks_round_trip_through_the_model_cache(model) -> None:
    prompt = SYSTEM_A[:64]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    layout = kv_layout_for(model.config, block_size=BLOCK_SIZE)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    blocks = [cache_block(cache, i, layout) for i in range(4)]
    assert blocks[0].shape == layout.block_shape
    rebuilt = blocks_to_cache(blocks, layout, model.config, device=model.device, dtype=model.dtype)
    assert rebuilt.get_seq_length() == 64
    assert all(
        torch.equal(a, b)
        for a, b in zip(blocks, [cache_block(rebuilt, i, layout) for i in range(4)], strict=True)
    )


def test_second_request_reuses_the_system_prompt_exactly(kv, model) -> None:
    runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE)
    first = runner.prefill(SYSTEM_A + USER_1)
    assert (first.reused_tokens, first.stored_blocks) == (0, 140 // BLOCK_SIZE)
    prompt = SYSTEM_A + USER_2
    second = runner.prefill(prompt)
    assert second.reused_tokens == 96  # 6 full blocks of the system prompt
    assert second.computed_tokens == len(prompt) - 96
    assert second.stored_blocks == len(prompt) // BLOCK_SIZE - 6
    assert torch.allclose(second.logits, full_logits(model, prompt)[96:], atol=ATOL, rtol=RTOL)


def test_fully_cached_prompt_recomputes_its_last_block(kv, model) -> None:
    runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE)
    prompt = SYSTEM_A[:64]  # exactly 4 blocks
    assert runner.prefill(prompt).stored_blocks == 4
    again = runner.prefill(prompt, logits_to_keep=1)
    assert (again.hit_tokens, again.reused_tokens, again.computed_tokens) == (64, 48, 16)
    assert again.stored_blocks == 0
    assert again.cache.get_seq_length() == 64
    assert torch.allclose(again.logits, full_logits(model, prompt)[-1:], atol=ATOL, rtol=RTOL)


def test_short_prompts_and_no_store(kv, model) -> None:
    runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE, store=False)
    short = runner.prefill(SYSTEM_A[:15])
    assert (short.reused_tokens, short.computed_tokens, short.stored_blocks) == (0, 15, 0)
    assert runner.prefill(SYSTEM_A[:40]).stored_blocks == 0
    assert runner.prefill(SYSTEM_A[:40]).reused_tokens == 0
    with pytest.raises(InvalidArgument):
        runner.prefill([])
    with pytest.raises(InvalidArgument):
        runner.prefill(torch.tensor([SYSTEM_A[:20], SYSTEM_A[:20]]))
    assert runner.prefill(torch.tensor([SYSTEM_A[:20]])).computed_tokens == 20


def test_runner_without_the_pool_mapped_moves_blocks_over_grpc(kv_target, model) -> None:
    prompt = SYSTEM_A + USER_2
    with SyncClient(kv_target, tenant="remote", map_pool=False) as kv:
        runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE)
        assert runner.prefill(SYSTEM_A + USER_1).stored_blocks == 8  # WriteBlocks
        result = runner.prefill(prompt)  # ReadBlocks
    assert result.reused_tokens == 96
    assert torch.allclose(result.logits, full_logits(model, prompt)[96:], atol=ATOL, rtol=RTOL)


def test_a_block_rewritten_during_the_copy_is_recomputed(kv, model, monkeypatch) -> None:
    runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE)
    runner.prefill(SYSTEM_A + USER_1)
    hit_views = CachedPrefill._hit_views

    def views_then_rewritten(self, hit, count):  # type: ignore[no-untyped-def]
        views = hit_views(self, hit, count)
        # Another writer takes block 3's slot as the copy starts: its bytes
        # change and (as the node does first) its stamp moves on.
        views[3].fill_(7.0)
        spec = hit.mapping.descriptor
        arena, local = divmod(int(hit.slots[3]), spec.slots_per_arena)
        with open(spec.arenas[arena].stamp_path, "r+b") as stamps:
            stamps.seek(16 * local)
            stamps.write(struct.pack("<QQ", int(hit.generations[3]) + 10**9, 0))
        return views

    monkeypatch.setattr(CachedPrefill, "_hit_views", views_then_rewritten)
    prompt = SYSTEM_A + USER_2
    result = runner.prefill(prompt)
    assert result.hit_tokens == 96 and result.reused_tokens == 3 * BLOCK_SIZE
    assert torch.allclose(result.logits, full_logits(model, prompt)[48:], atol=ATOL, rtol=RTOL)


def test_decoding_continues_from_the_returned_cache(kv, model) -> None:
    runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE)
    runner.prefill(SYSTEM_A + USER_1)
    prompt = SYSTEM_A + USER_2
    result = runner.prefill(prompt, logits_to_keep=1)
    assert result.reused_tokens > 0
    step = int(result.logits[-1].argmax())
    kwarg = cache_argument(model)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[step]]), **{kwarg: result.cache}, use_cache=True)
    expected = full_logits(model, [*prompt, step])[-1]
    assert torch.allclose(out.logits[0, -1], expected, atol=ATOL, rtol=RTOL)


# --- separate runner processes ---------------------------------------------------------


@pytest.fixture(scope="module")
def process_a(kv_target: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runner process A prefilled SYSTEM_A + USER_1 as tenant "mp" and stored its blocks."""
    [a] = run_runners(
        kv_target, tmp_path_factory.mktemp("a"), (SYSTEM_A + USER_1, ["--tenant", "mp"])
    )
    assert (a["reused_tokens"], a["stored_blocks"]) == (0, 8)
    return a


def test_process_b_reuses_what_process_a_stored(kv_target, tmp_path, model, process_a) -> None:
    prompt = SYSTEM_A + USER_2
    [b] = run_runners(kv_target, tmp_path, (prompt, ["--tenant", "mp"]))
    assert b["namespace"] == process_a["namespace"]
    assert (b["hit_tokens"], b["reused_tokens"]) == (96, 96)
    assert torch.allclose(b["logits"], full_logits(model, prompt)[96:], atol=ATOL, rtol=RTOL)


def test_another_system_prompt_or_tenant_gets_nothing(kv_target, model, process_a) -> None:
    prompt = SYSTEM_A + USER_2
    with SyncClient(kv_target, tenant="mp") as kv:
        runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE, store=False)
        assert runner.namespace.id == process_a["namespace"]
        assert runner.prefill(SYSTEM_A[:64]).hit_tokens == 64  # A's blocks are there
        assert runner.prefill(SYSTEM_B + USER_1).hit_tokens == 0  # same user prompt, no reuse
    with SyncClient(kv_target, tenant="other") as kv:
        runner = CachedPrefill(kv, model, "tiny-llama", block_size=BLOCK_SIZE)
        result = runner.prefill(prompt)
    assert result.hit_tokens == 0
    assert torch.allclose(result.logits, full_logits(model, prompt), atol=ATOL, rtol=RTOL)


def test_kv_of_another_model_is_refused(kv_target, process_a) -> None:
    prompt = SYSTEM_A + USER_1
    deeper = tiny_llama(layers=3)
    with SyncClient(kv_target, tenant="mp") as kv:
        a_namespace = CachedPrefill(kv, tiny_llama(), "tiny-llama", block_size=BLOCK_SIZE)
        # Another layout claiming A's exact namespace: the node refuses it.
        with pytest.raises(AlreadyExists):
            CachedPrefill(
                kv,
                deeper,
                a_namespace.namespace_model_id,
                block_size=BLOCK_SIZE,
                fingerprint="none",
            )
        # Under the same model id, the config fingerprint makes it another namespace: a miss.
        other = CachedPrefill(kv, deeper, "tiny-llama", block_size=BLOCK_SIZE)
        assert other.namespace.id != process_a["namespace"]
        assert other.prefill(prompt).hit_tokens == 0
        # Same layout, other weights: the weights fingerprint tells them apart.
        seed0 = CachedPrefill(kv, tiny_llama(0), "tiny-llama", fingerprint="weights")
        seed1 = CachedPrefill(kv, tiny_llama(1), "tiny-llama", fingerprint="weights")
        assert seed0.prefill(prompt).stored_blocks == 8
        assert seed0.prefill(prompt).hit_tokens == 128
        assert seed1.prefill(prompt).hit_tokens == 0


def test_on_a_cuda_pool_pins_are_released_only_after_the_copies(tmp_path, model) -> None:
    # A node on the fake CUDA runtime: the hit's views are "GPU memory" and the
    # copies out of them are queued work; Release must come after they completed.
    from service.config import Config
    from tests.kvstore.pool.fake_cuda import FakeCudaRuntime
    from tests.service.cuda_node import threaded_node

    rt = FakeCudaRuntime(total_bytes=64 << 20)
    config = Config(
        port=0,
        metrics_port=0,
        device="cuda:0",
        capacity_bytes=32 << 20,
        namespace_capacity_bytes=4 << 20,
        shm_dir=str(tmp_path),
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
    )
    with threaded_node(config, rt) as node, SyncClient(node.address, tenant="t") as kv:
        real = kv.client._rpc.call

        async def call(method, request, *args, **kwargs):  # type: ignore[no-untyped-def]
            rt.calls.append(f"rpc:{method.name}")
            return await real(method, request, *args, **kwargs)

        kv.client._rpc.call = call  # type: ignore[method-assign]
        runner = CachedPrefill(kv, model, "tiny", fingerprint="none")
        prompt = SYSTEM_A + USER_1
        runner.prefill(prompt)
        rt.calls.clear()
        second = runner.prefill(prompt)
        assert second.reused_tokens > 0
        calls = rt.calls[: rt.calls.index("rpc:Release") + 1]
        assert calls[0] == "rpc:Lookup" and "synchronize:0" in calls, calls
        torch.testing.assert_close(
            second.logits, full_logits(model, prompt)[-len(second.logits) :], atol=ATOL, rtol=RTOL
        )


def test_release_waits_on_the_streams_the_copies_ran_on(monkeypatch, model) -> None:
    # GPU views: the copies out of them ran on the current streams of the pool's
    # GPU and the model's GPU; those are what the release must wait for.
    from types import SimpleNamespace

    from tests.kvstore.pool.fake_cuda import FakeTorchCuda

    gpu = FakeTorchCuda()
    gpu.install(monkeypatch)
    runner = CachedPrefill.__new__(CachedPrefill)
    runner.model = SimpleNamespace(device=torch.device("cuda", 1))  # type: ignore[assignment]
    view = SimpleNamespace(device=torch.device("cuda", 0))
    streams = runner._read_streams([view])  # type: ignore[list-item]
    assert streams is not None
    assert sorted(s.name for s in streams) == ["default0", "default1"]
    runner.model = SimpleNamespace(device=torch.device("cpu"))  # type: ignore[assignment]
    assert [s.name for s in runner._read_streams([view])] == ["default0"]  # type: ignore[list-item,union-attr]
    assert runner._read_streams([torch.zeros(1)]) is None  # host views: nothing queued
