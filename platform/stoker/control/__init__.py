"""The control plane: deployments and their revisions, rollout, keys' store, cascade routes' store,
cost and history, what gateways learn and report (`cluster`), leader election. It owns the warm pools
(`warm_pool`) and the activators of `stoker up`, and is the only part of `stoker` that imports
`warm_pool.pool`, its lifecycle or a backend.

May import: `stoker.gateway`, `stoker.spec`, the shared helpers, `warm_pool`, `activator`,
`snapshots`. Imported by: `stoker.api`, `stoker.serve`, `stoker.cli` (for what runs in its process).
"""
