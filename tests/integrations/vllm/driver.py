"""A vLLM engine process for the tests and the benchmark, driven over stdin/stdout.

    KVSTORE_VLLM_PYTHON driver.py '{"model": DIR, "block_size": 32, "connector": {...}}'

Builds one ``LLM`` (eager, float32, prefix caching on; with the kvstore
connector when ``connector`` is given: its ``kv_connector_extra_config``),
prints ``@@READY``, then answers one JSON command per stdin line with one
``@@RESULT {...}`` line (vLLM logs to the same stdout):

- ``{"prompts": [[ids...], ...], "max_tokens": 8}``: greedy generation;
  answers each prompt's tokens, the logprob of each chosen token and the
  time to first token (with ``"prompt_logprobs": true`` also each prompt token's
  logprob, the first one None), plus the deltas of vLLM's prefix-cache counters
  (``external_hits``: tokens the connector supplied; ``local_hits``) and of
  its preemptions, and of the connector's load counters on vLLM's metrics
  (``kvstore_loaded``, ``kvstore_load_errors``, ``kvstore_load_moved``,
  ``kvstore_checksum_failed``). The prompts run one at a time, or all in one
  ``generate`` call with ``"batch": true``.
- ``{"reset_prefix_cache": true}``: empties vLLM's own prefix cache.
- ``{"exit": true}``: shuts the engine down.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

COUNTERS = {
    "vllm:external_prefix_cache_hits": "external_hits",
    "vllm:external_prefix_cache_queries": "external_queries",
    "vllm:prefix_cache_hits": "local_hits",
    "vllm:prefix_cache_queries": "local_queries",
    "vllm:num_preemptions": "preemptions",
    "vllm:kvstore_loaded_blocks": "kvstore_loaded",
    "vllm:kvstore_load_error_blocks": "kvstore_load_errors",
    "vllm:kvstore_load_moved_blocks": "kvstore_load_moved",
    "vllm:kvstore_load_checksum_failed_blocks": "kvstore_checksum_failed",
}


def counters(llm: Any) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += float(getattr(metric, "value", 0) or 0)
    return out


def build(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec.get("dtype", "float32"),
        "enforce_eager": True,
        "block_size": spec.get("block_size", 32),
        "max_model_len": spec.get("max_model_len", 2048),
        "max_num_batched_tokens": spec.get("max_num_batched_tokens", 8192),
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec.get("max_num_seqs"):
        kwargs["max_num_seqs"] = spec["max_num_seqs"]
    if spec.get("tensor_parallel_size", 1) > 1:  # one worker process per rank
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("attention_backend"):  # e.g. CPU_MLA: the reference MLA kernel, float32
        kwargs["attention_config"] = {"backend": spec["attention_backend"]}
    if spec.get("kv_events_config"):  # vLLM's own KV events over ZMQ (docs/events.md)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    if spec.get("connector") is not None:
        # "faulty": the test connector with switchable faults (tests/integrations/vllm/faulty.py).
        faulty = spec.get("faulty", False)
        kwargs["kv_transfer_config"] = {
            "kv_connector": "FaultyConnector" if faulty else "KVStoreConnector",
            "kv_connector_module_path": (
                "tests.integrations.vllm.faulty" if faulty else "kvstore.integrations.vllm"
            ),
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["connector"],
        }
    return LLM(**kwargs)


def generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=command.get("max_tokens", 8),
        logprobs=0,
        ignore_eos=True,
        prompt_logprobs=0 if command.get("prompt_logprobs") else None,
    )
    before = counters(llm)
    results = []
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
    # One at a time (per-prompt timings and counters), or all at once (a real batch).
    groups = [prompts] if command.get("batch") else [[p] for p in prompts]
    for group in groups:
        start = time.perf_counter()
        outs = llm.generate(group, params, use_tqdm=False)
        wall = time.perf_counter() - start
        for out in outs:
            results.append(result_of(out, wall))
    after = counters(llm)
    return {"results": results, **{k: after[k] - before[k] for k in after}}


def result_of(out: Any, wall: float) -> dict[str, Any]:
    completion = out.outputs[0]
    logprobs = [
        float(step[token].logprob)
        for step, token in zip(completion.logprobs or [], completion.token_ids, strict=False)
    ]
    metrics = out.metrics
    ttft = None
    if metrics is not None and getattr(metrics, "first_token_latency", None):
        ttft = float(metrics.first_token_latency)
    prompt_logprobs = [
        None if step is None else float(step[token].logprob)
        for step, token in zip(out.prompt_logprobs or [], out.prompt_token_ids or [], strict=False)
    ]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "cached_tokens": int(out.num_cached_tokens or 0),
        "ttft": ttft,
        "wall": wall,
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    llm = build(spec)
    print("@@READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        if command.get("reset_prefix_cache"):
            answer: dict[str, Any] = {"reset": bool(llm.reset_prefix_cache())}
        else:
            answer = generate(llm, command)
        print("@@RESULT " + json.dumps(answer), flush=True)
    del llm
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
