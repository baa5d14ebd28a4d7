"""The data plane: one request, from the caller's key to the activator that answers it. Auth and
tenant keys, rate limits, the revision split, cascade routes, the request taps (cost, request log,
usage, revisions), and `stoker gateway`'s plane that learns READY endpoints from the controller.

May import: `stoker.spec`, the shared helpers, `activator`. Never `stoker.control`, `warm_pool.pool`,
its lifecycle or a backend: a `stoker gateway` process stays small (pinned by
`tests/platform/gateway/test_imports.py`). Imported by: `stoker.control`, `stoker.api`, `stoker.serve`.
"""
