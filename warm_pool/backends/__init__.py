"""Where instances run, behind one seam (as httpx's `_transports/`): the `Backend` protocol the pool
declares (`base`), and its implementations: engine processes on this machine (`local`, with the
records of what it started, `records`, and its process handles, `procs`), pods on Kubernetes
(`kube`, with `kube_pod`, `kube_status`, `kube_watch`), and engines held in memory (`memory`) that
the pool's tests drive on a fake clock.

Nothing is imported here: a process loads only the backend it runs (the gateway loads none).
"""
