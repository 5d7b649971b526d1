"""The gRPC API of a node: servicers that only translate, and what they share.

- `servicer`: `KVStoreServicer`, the one class gRPC registers, assembled from
  `blocks` (lookup, reserve, commit, release, leases), `data` (byte
  streaming), `admin` (stats, namespaces, events, admin verbs) and `peer`
  (node-to-node FetchBlocks) and `query` (QueryPrefix for routers, over the
  transport-free `prefix_query` that ``POST /query`` shares), all on
  `base.ServicerBase`.
- `translate`: proto <-> domain types; `validate`: request fields -> domain
  values or `FieldError`; `errors`: the one table from typed errors to
  status codes, and the guards that apply it.

Nothing is imported here, so importing one module never pulls in the rest
(`service.node` uses `translate` and `validate`, the servicers use the node).
"""
