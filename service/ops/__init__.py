"""What operators see of a node: Prometheus metrics, the web page, event fan-out.

- `metrics`: the Prometheus registry, collectors and the HTTP endpoint.
- `web`: the status page (``web/index.html``) and its JSON endpoints.
- `watch_hub`: fans the node's cache events out to ``WatchEvents`` callers.
"""
