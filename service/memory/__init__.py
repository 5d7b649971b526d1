"""The node's memory: the budget, the namespace pools and the policy over them.

- `budget`: `PoolManager`, the budget's accounting, one `ArenaPool` per
  namespace, pool files and the pool epoch.
- `policy`: `NamespaceMemory`, which arenas move in and out of pools
  (headroom ahead of need, growth on demand, give-back, drop).
- `held`: CUDA arenas out of a pool, kept until no runner can still map them.
"""
