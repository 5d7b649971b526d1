"""What ops tooling shows, shared by the ``kvstore`` CLI and the node's web page.

Pure and synchronous views (the prefix tree of a namespace, plain-JSON
summaries of a node's stats) that both sides draw, so that neither imports
the other: the CLI and `service` both depend on this package, never on each
other.
"""
