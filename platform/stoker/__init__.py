"""Stoker's control plane and composition root: CLI, gateway, registry, metrics and the CPU engine."""

__version__ = "0.1.0"
