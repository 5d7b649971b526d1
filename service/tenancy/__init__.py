"""Who is calling: tenants, their tokens and salts, and the admin rule.

- `tenants`: the tenants file (token digests, namespaces, quotas).
- `callers`: `TenantResolver` (metadata -> `Caller`) and `ChainRoots`
  (each tenant's secret salt and chain roots).
- `auth`: bearer tokens and the admin rule (token, or loopback when unset).
"""
