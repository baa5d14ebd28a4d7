"""The node agent (`stoker node`): a GPU node's local snapshot store kept stocked, and its GPUs'
figures.

May import: `stoker.spec`, the shared helpers, `snapshots`, `warm_pool`'s pure helpers (labels,
backoff). Imported by: `stoker.cli`, `stoker.serve`.
"""
