"""What a node starts for vLLM KV events: the publisher and one subscriber per engine.

Built by `Node` from its settings (``kv_events_endpoint``,
``engine_kv_events``); started on the node's loop by the server and stopped
on shutdown. Without either setting nothing here imports pyzmq or msgpack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.events import CacheEvent
from kvstore.types import NamespaceId
from service.config import Config, ConfigError
from service.vllm_events.engine_index import EngineIndex
from service.vllm_events.metrics import EventFigures
from service.vllm_events.publisher import KvEventPublisher
from service.vllm_events.subscriber import EngineSubscriber, zmq_modules

log = logging.getLogger(__name__)


def default_medium(config: Config) -> str:
    """``kv_events_medium``, or the node's tier: "GPU_kvstore" on CUDA, else "CPU_kvstore"."""
    if config.kv_events_medium:
        return config.kv_events_medium
    return "GPU_kvstore" if config.device.startswith("cuda") else "CPU_kvstore"


class KvEvents:
    """The node's KV-event publisher and engine subscribers."""

    def __init__(
        self,
        config: Config,
        index: EngineIndex | None,
        block_size_of: Callable[[NamespaceId], int | None],
        wall: Callable[[], float],
    ) -> None:
        self.config = config
        self.index = index
        self._block_size_of = block_size_of
        self._wall = wall
        self.publisher: KvEventPublisher | None = None
        self.subscribers: list[EngineSubscriber] = []
        self._async_ctx: Any = None

    def start(self) -> None:
        """Bind the publisher and connect the subscribers (on the node's loop)."""
        config = self.config
        if config.kv_events_endpoint:
            self.publisher = self._bind_publisher()
            log.info(
                "publishing KV events on %s (replay: %s)",
                self.publisher.endpoint,
                self.publisher.replay_endpoint or "off",
            )
        if self.index is not None and config.engine_kv_events:
            _, zmq_asyncio = zmq_modules()
            self._async_ctx = zmq_asyncio.Context()
            for source in config.engine_kv_events:
                sub = EngineSubscriber(source, self.index, self._async_ctx)
                sub.start()
                self.subscribers.append(sub)
                log.info("ingesting KV events of engine %s from %s", source.name, source.endpoint)

    def _bind_publisher(self) -> KvEventPublisher:
        """The publisher on its endpoints; `ConfigError` naming them when they cannot be bound."""
        config = self.config
        zmq, _ = zmq_modules()
        try:
            return KvEventPublisher(
                config.kv_events_endpoint,
                replay_endpoint=config.kv_events_replay_endpoint,
                topic=config.kv_events_topic,
                medium=default_medium(config),
                buffer_batches=config.kv_events_buffer_batches,
                array_events=config.kv_events_encoding == "array",
                block_size_of=self._block_size_of,
                wall=self._wall,
            )
        except zmq.ZMQError as exc:
            raise ConfigError(
                f"kv_events_endpoint {config.kv_events_endpoint!r} / kv_events_replay_endpoint "
                f"{config.kv_events_replay_endpoint!r} cannot be bound: {exc}"
            ) from None

    def figures(self) -> EventFigures:
        """The metrics' figures (`service.vllm_events.metrics`); call on the loop."""
        publisher, index = self.publisher, self.index
        blocks: dict[tuple[str, str], int] = {}
        counts: dict[tuple[str, str], int] = {}
        if index is not None:
            for name, state in index.engines.items():
                for medium, held in state.held.items():
                    blocks[(name, medium)] = len(held)
                for kind, n in state.counts.items():
                    counts[(name, kind)] = n
        return EventFigures(
            published=publisher.sent if publisher is not None else None,
            dropped=publisher.dropped if publisher is not None else 0,
            blocks=blocks,
            counts=counts,
        )

    def publish(self, events: Iterable[CacheEvent], medium: str | None = None) -> None:
        """Hand the node's block events to the publisher (no-op when off); ``medium``:
        the tier they happened in, when not `kv_events_medium` (the disk tier's)."""
        if self.publisher is not None:
            self.publisher.publish(events, medium)

    async def stop(self) -> None:
        """Stop the subscribers and the publisher; idempotent."""
        subscribers, self.subscribers = self.subscribers, []
        for sub in subscribers:
            await sub.stop()
        if self._async_ctx is not None:
            self._async_ctx.term()
            self._async_ctx = None
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()
