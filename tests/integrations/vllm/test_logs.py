"""`follow_vllm_logging`: kvstore's records go to vLLM's handlers, once, at vLLM's level."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvstore.integrations.vllm.logs import follow_vllm_logging


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger, io.StringIO]]:
    """A fake ``vllm`` logger configured as vLLM configures it; both restored afterwards."""
    ours, theirs = logging.getLogger("kvstore"), logging.getLogger("vllm")
    saved = {
        logger: (list(logger.handlers), logger.level, logger.propagate) for logger in (ours, theirs)
    }
    for logger in (ours, theirs):
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    theirs.addHandler(handler)
    theirs.setLevel(logging.INFO)
    theirs.propagate = False
    try:
        yield ours, theirs, stream
    finally:
        for logger, (handlers, level, propagate) in saved.items():
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate


def test_kvstore_info_lines_reach_vllms_handler_once(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO],
) -> None:
    ours, theirs, stream = loggers
    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)
    logging.getLogger().addHandler(root_handler)
    try:
        follow_vllm_logging()
        follow_vllm_logging()  # idempotent: still one handler, one line per record
        logging.getLogger("kvstore.integrations.vllm.connector").info("node 127.0.0.1:50051")
        logging.getLogger("kvstore.integrations.vllm.connector").debug("not at INFO")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert ours.handlers == theirs.handlers
    assert ours.level == logging.INFO
    assert not ours.propagate
    assert stream.getvalue() == "kvstore.integrations.vllm.connector INFO node 127.0.0.1:50051\n"
    assert root_stream.getvalue() == ""  # not printed twice


def test_vllms_level_is_followed(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO],
) -> None:
    ours, theirs, _ = loggers
    theirs.setLevel(logging.DEBUG)  # VLLM_LOGGING_LEVEL=DEBUG
    follow_vllm_logging()
    assert ours.level == logging.DEBUG


def test_info_when_vllms_logger_has_no_level(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO],
) -> None:
    ours, theirs, _ = loggers
    theirs.setLevel(logging.NOTSET)
    follow_vllm_logging()
    assert ours.level == logging.INFO


def test_a_configured_kvstore_logger_is_left_alone(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO],
) -> None:
    ours, _, _ = loggers
    own = logging.StreamHandler(io.StringIO())
    ours.addHandler(own)
    follow_vllm_logging()
    assert ours.handlers == [own]
    assert ours.propagate
    assert ours.level == logging.NOTSET


def test_an_explicit_kvstore_level_is_kept(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO],
) -> None:
    ours, theirs, _ = loggers
    ours.setLevel(logging.WARNING)
    follow_vllm_logging()
    assert ours.handlers == theirs.handlers
    assert ours.level == logging.WARNING


def test_nothing_when_vllm_does_not_configure_logging(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO],
) -> None:
    ours, theirs, _ = loggers
    theirs.handlers.clear()  # VLLM_CONFIGURE_LOGGING=0
    follow_vllm_logging()
    assert ours.handlers == []
    assert ours.propagate


def test_a_link_that_recovers_says_so_and_warns_of_the_next_failure_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker's link is never registered by itself (its saves register through the SDK):
    a save that goes through after failures must still end the quiet spell, or every
    later failure of that worker stays at DEBUG."""
    from kvstore.integrations.vllm.config import ConnectorConfig
    from kvstore.integrations.vllm.node_link import NodeLink
    from tests.client.blocks import LAYOUT

    link = NodeLink(
        ConnectorConfig(target="127.0.0.1:1", tenant="acme", retry_interval=0.0),
        "vllm:test-logs",
        LAYOUT,
        client_name="test",
        map_pool=False,
    )
    failure = ConnectionRefusedError("refused")
    caplog.set_level(logging.DEBUG, logger="kvstore")
    link.failed("store on", failure)
    link.failed("store on", failure)  # the same spell: not warned again
    link.succeeded()
    link.succeeded()  # said once
    link.failed("store on", failure)
    levels = [(r.levelno, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert levels == [
        (logging.WARNING, "kvstore: could not store on node 127.0.0.1:1"),
        (logging.DEBUG, "kvstore: could not store on node 127.0.0.1:1"),
        (logging.WARNING, "kvstore node 127.0.0.1:1 is back; reusing cached prefixes"),
        (logging.WARNING, "kvstore: could not store on node 127.0.0.1:1"),
    ]
