"""What every part agrees on: each deployment, route, key and traffic field's type, default, range
and validation, written once (as Knative's `revision_types/defaults/validation.go`), and what the
two planes send each other. Pure: no I/O, no clock.

May import: the shared helpers (`stoker.errors`) and pure parts of `warm_pool` (policy names and
their settings' checks). Imported by: every other folder.
"""
