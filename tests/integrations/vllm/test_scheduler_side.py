"""The connector's scheduler side against a real in-process node, without vLLM.

vLLM's requests and scheduler outputs are stood in for by plain objects with
the fields the connector reads; the node, the client and its lease are real.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from kvstore.integrations.vllm.metadata import KVStoreWorkerReport
from service.server import Server
from tests.integrations.vllm.scheduler_fakes import (
    BS,
    MODEL,
    answer,
    pinned,
    prefill_step,
    request,
    scheduler_side,
    step,
    store_prompt,
)
from tests.waiting import wait_until


async def test_pins_of_a_sent_load_outlive_the_request_until_the_worker_reports(
    kv_server: Server,
) -> None:
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(3, 3 + 3 * BS), 7]
        assert store_prompt(address, tokens) == 3
        side = scheduler_side(address, lookup_timeout=5.0)
        try:
            req = request("r1", tokens)
            assert answer(side, req) == 3 * BS
            assert pinned(address) == 3
            side.after_alloc(req, [[10, 11, 12, 13]], 3 * BS)
            meta = side.build_meta(step())
            (load,) = meta.loads
            assert load.block_ids == (10, 11, 12)
            assert time.monotonic() < load.pins_until  # the worker may copy until then
            # vLLM schedules a step ahead: the request ends while its copy is queued.
            assert side.request_finished(req, []) is False
            side.build_meta(step())
            assert pinned(address) == 3, "pins dropped while the worker may still copy"
            side.on_worker_output(
                SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerReport(loaded={("r1", 0)}))
            )
            # The Release goes out in the background.
            wait_until(lambda: pinned(address) == 0, within=10, interval=0.02, what="no pins")
            assert pinned(address) == 0
            assert side.pins_in_use == 0
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)


async def test_a_hit_vllm_does_not_take_is_released_and_never_loaded(
    kv_server: Server,
) -> None:
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(100, 100 + 2 * BS), 5]
        assert store_prompt(address, tokens) == 2
        side = scheduler_side(address)
        try:
            req = request("r2", tokens)
            assert answer(side, req) == 2 * BS
            side.after_alloc(req, [[1, 2, 3]], 0)  # vLLM dropped the hit
            assert side.build_meta(step()).loads == []
            wait_until(lambda: pinned(address) == 0, within=10, interval=0.02, what="no pins")
            assert pinned(address) == 0
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)


def decode_step(req: Any, computed: int, new_block_ids: list[int] | None = None) -> Any:
    """A step scheduling one token of ``req`` (a decode), ``computed`` tokens before it."""
    cached = SimpleNamespace(
        req_ids=[req.request_id],
        new_block_ids=[(new_block_ids,) if new_block_ids else None],
        num_computed_tokens=[computed],
        resumed_req_ids=set(),
    )
    return step(num_scheduled_tokens={req.request_id: 1}, scheduled_cached_reqs=cached)


def sample(req: Any, token: int) -> None:
    """The request's next output token, as vLLM appends it after a step."""
    req.all_token_ids.append(token)
    req.num_tokens += 1


async def test_output_blocks_are_saved_under_the_hashes_a_next_turn_prompt_gets(
    kv_server: Server,
) -> None:
    address = kv_server.address

    def scenario(save_decode: bool) -> list[tuple[int, int]]:
        side = scheduler_side(address, save_decode=save_decode)
        link = side.link
        try:
            prompt = [*range(200, 200 + 2 * BS), 9, 9]  # 2 full blocks and 2 tokens
            req = request(f"chat-{save_decode}", prompt)
            assert answer(side, req) == 0
            side.after_alloc(req, [[7, 8, 9]], 0)
            planned = [
                (s.first_new, len(s.hashes))
                for s in side.build_meta(prefill_step(req, [7, 8, 9])).saves
            ]
            sample(req, 11)  # the first output token, sampled by the prefill
            out = 11
            while req.num_tokens < 3 * BS + 3:  # decode past the third block's end
                computed = req.num_tokens - 1
                new_ids = [10] if computed == 3 * BS else None
                meta = side.build_meta(decode_step(req, computed, new_ids))
                planned += [(s.first_new, len(s.hashes)) for s in meta.saves]
                for save in meta.saves:
                    # The chain a later prompt repeating this text (a next turn) gets.
                    next_turn = link.namespace().hash([*req.all_token_ids, 42, 43])  # type: ignore[union-attr]
                    assert list(save.hashes) == next_turn[: len(save.hashes)]
                    assert save.block_ids == (7, 8, 9, 10)[: len(save.hashes)]
                out += 1
                sample(req, out)
            # Everything full was planned in the step that filled it: nothing held back.
            req.num_computed_tokens = req.num_tokens - 1
            assert side.request_finished(req, [[7, 8, 9, 10]]) is False
            assert side.build_meta(step()).saves == []
            return planned
        finally:
            side.shutdown()

    # Block 2 fills in the decode step that computes token 3 * BS - 1.
    assert await asyncio.to_thread(scenario, True) == [(0, 2), (2, 3)]
    assert await asyncio.to_thread(scenario, False) == [(0, 2)]


async def test_a_finished_request_keeps_its_blocks_until_its_last_full_blocks_are_copied_out(
    kv_server: Server,
) -> None:
    address = kv_server.address

    def scenario() -> None:
        side = scheduler_side(address)
        link = side.link
        try:
            req = request("async", [*range(300, 300 + BS), 1, 2])
            assert answer(side, req) == 0
            side.after_alloc(req, [[4, 5]], 0)
            (first,) = side.build_meta(prefill_step(req, [4, 5])).saves
            assert len(first.hashes) == 1 and not first.frees_blocks
            # With asynchronous scheduling the step that completed block 1 ran before
            # its last token was known: nothing could be planned then.
            for token in range(BS):
                sample(req, 500 + token)
            req.num_computed_tokens = 2 * BS + 1
            assert side.request_finished(req, [[4, 5]]) is True  # vLLM keeps the blocks
            (last,) = side.build_meta(step()).saves
            assert last.frees_blocks and last.request_id == "async"
            assert (last.first_new, last.block_ids) == (1, (4, 5))
            assert list(last.hashes) == link.namespace().hash(req.all_token_ids)[:2]  # type: ignore[union-attr]
            assert side.build_meta(step()).saves == []
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)


async def test_a_tensor_parallel_engine_looks_up_every_ranks_namespace_and_loads_the_shortest(
    kv_server: Server,
) -> None:
    address = kv_server.address
    ranks = [f"{MODEL}#tp-2.0", f"{MODEL}#tp-2.1"]

    def scenario() -> None:
        tokens = [*range(400, 400 + 3 * BS), 1]
        assert store_prompt(address, tokens, ranks[0]) == 3
        assert store_prompt(address, tokens[: 2 * BS], ranks[1]) == 2  # rank 1 has 2
        side = scheduler_side(address, ranks)
        link = side.link
        try:
            req = request("tp", tokens)
            assert answer(side, req) == 2 * BS  # the blocks every rank has
            assert pinned(address) == 5  # both ranks' hits, pinned until the load ends
            side.after_alloc(req, [[20, 21, 22, 23]], 2 * BS)
            meta = side.build_meta(prefill_step(req, [20, 21, 22, 23]))
            assert [(load.unit, load.block_ids) for load in meta.loads] == [
                (0, (20, 21)),
                (1, (20, 21)),
            ]
            # Each rank saves block 2 under its own namespace's chain.
            namespaces = link.namespaces()
            assert namespaces is not None
            saves = {save.unit: save for save in meta.saves}
            for rank, ns in enumerate(namespaces):
                assert list(saves[rank].hashes) == ns.hash(tokens)[:3]
                assert saves[rank].first_new == 2
            assert saves[0].hashes[0] != saves[1].hashes[0]
            # A commit counts once every rank confirmed it (reports come step by step).
            side.on_worker_output(
                SimpleNamespace(
                    kv_connector_worker_meta=KVStoreWorkerReport(
                        loaded={("tp", 0), ("tp", 1)}, saved={("tp", 0): 3}
                    )
                )
            )
            tracked = side._requests["tp"]
            assert tracked.saved_blocks == 2
            side.on_worker_output(
                SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerReport(saved={("tp", 1): 3}))
            )
            assert tracked.saved_blocks == 3
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)


async def test_a_save_planned_while_the_node_restarts_waits_for_it_instead_of_being_lost(
    kv_server: Server,
) -> None:
    """After a node restart the client marks its namespaces stale and registers them
    again; a request whose save falls in that window must be saved once the namespace
    is back, not dropped for good (it was: the request was marked unkeyable)."""
    address = kv_server.address

    def scenario() -> None:
        side = scheduler_side(address)
        link = side.link
        try:
            req = request("restart", [*range(700, 700 + 2 * BS), 5])
            assert answer(side, req) == 0
            side.after_alloc(req, [[3, 4]], 0)
            client = link.client
            assert client is not None
            # What a reply from a restarted node does: a new epoch, the namespaces stale.
            assert client.client.session.observe_epoch(client.client.epoch + 1)
            assert side.build_meta(prefill_step(req, [3, 4])).saves == []
            # The link registers the namespace again (its next use starts it).
            wait_until(lambda: link.namespaces() is not None, what="the namespace registered again")
            sample(req, 6)
            meta = side.build_meta(decode_step(req, 2 * BS + 1))
            (save,) = meta.saves
            assert (save.first_new, save.block_ids) == (0, (3, 4))
            assert list(save.hashes) == link.namespace().hash(req.all_token_ids)[:2]  # type: ignore[union-attr]
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)
