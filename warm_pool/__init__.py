"""The warm pool: instances and their lifecycle, and the autoscaling policies that size it.

Nothing lives here yet. It will hold the instance state machine (PENDING → STARTING → READY ⇄
SLEEPING → DRAINING → STOPPED), instance backends (local processes, Kubernetes), engine launch specs
(vLLM, the CPU engine) and the pure scaling policies. It may import `snapshots`.
"""
