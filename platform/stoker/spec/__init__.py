"""What every part agrees on: each deployment, route, key and traffic field's type, default, range
and validation, written once (as Knative's `revision_types/defaults/validation.go`), and what the
two planes send each other. Pure: no I/O, no clock.

May import: the shared helpers (`stoker.errors`), pure parts of `warm_pool` (policy names, their
defaults and their settings' checks) and `activator`'s balance modes. Imported by: every other folder.
"""
