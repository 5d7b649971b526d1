"""The connector's log lines in vLLM's log.

vLLM configures only its own ``vllm`` logger (handlers, level, propagate
off) and leaves the root logger alone, so a ``kvstore`` record, at INFO,
reaches no handler and ``vllm serve`` never shows which node the engine uses
or whether it connected. `follow_vllm_logging` gives the ``kvstore`` logger
vLLM's handlers: the lines come out where vLLM's do, in vLLM's format
(with its ``(EngineCore pid=...)`` prefix).
"""

from __future__ import annotations

import logging

__all__ = ["follow_vllm_logging"]


def follow_vllm_logging() -> None:
    """Send the ``kvstore`` logger's records to vLLM's handlers; idempotent.

    Only when the ``kvstore`` logger has no handlers of its own (an
    application that configured it keeps its configuration) and vLLM's
    logger has some (``VLLM_CONFIGURE_LOGGING=0`` leaves logging to the
    application). The level becomes vLLM's (INFO by default) unless the
    ``kvstore`` logger has its own; propagation stops, so a handler that the
    root logger also has does not print each line twice.
    """
    ours = logging.getLogger("kvstore")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level if theirs.level != logging.NOTSET else logging.INFO)
    ours.propagate = False
