"""The admin API over HTTP: one module per resource (routes, revisions, cost, logs, the dashboard's
data) and the OpenAPI document. Handlers only: each parses and validates the request (`stoker.spec`),
calls the control plane (`stoker.control`) and shapes the answer; no state of its own.

May import: `stoker.control`, `stoker.gateway`, `stoker.spec` and the shared helpers
(`stoker.errors`, `stoker.http`, `stoker.paths`). Imported by: `stoker.serve`.
"""
