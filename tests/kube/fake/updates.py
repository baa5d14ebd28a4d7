"""What an update (a replace or a patch) of a pod may change, as the API server's ValidatePodUpdate
decides: a pod's spec is fixed once created, but for

    spec.containers[*].image, spec.initContainers[*].image
    spec.activeDeadlineSeconds    set where unset, or lowered; never raised, never removed
    spec.tolerations              new ones added; an existing one is changed only in its
                                  tolerationSeconds

Anything else (a container's args or env, a volume, `nodeName`, a container added) is refused,
422 Invalid, in the API server's words: `Pod "x" is invalid: spec: Forbidden: pod updates may not
change fields other than ...` (without the diff a real server appends). Fields are compared as
JSON with null and empty values left out, as a client's omitempty encoding sends them.
"""

from __future__ import annotations

import copy

UPDATABLE = (
    "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
    "`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"
)


def _bare(value: object) -> object:
    if isinstance(value, dict):
        kept = {k: _bare(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_bare(v) for v in value]
    return value


def _tolerations_errors(old: list[dict], new: list[dict]) -> list[str]:
    def same(a: dict, b: dict) -> bool:
        return {k: v for k, v in _bare(a).items() if k != "tolerationSeconds"} == {
            k: v for k, v in _bare(b).items() if k != "tolerationSeconds"
        }

    if all(any(same(o, n) for n in new) for o in old):
        return []
    return [
        "spec.tolerations: Forbidden: existing toleration can not be modified except its tolerationSeconds"
    ]


def _deadline_errors(old: int | None, new: int | None) -> list[str]:
    if new is None and old is not None:
        return [
            "spec.activeDeadlineSeconds: Invalid value: null: must not update from a positive integer to nil value"
        ]
    if new is not None and old is not None and new > old:
        return [
            f"spec.activeDeadlineSeconds: Invalid value: {new}: must be less than or equal to previous value"
        ]
    return []


def pod_update_errors(old_spec: dict, new_spec: dict) -> list[str]:
    """The field errors of changing a pod's spec from `old_spec` to `new_spec`; [] if allowed."""
    for field in ("containers", "initContainers"):
        if len(old_spec.get(field) or []) != len(new_spec.get(field) or []):
            return [f"spec.{field}: Forbidden: pod updates may not add or remove containers"]
    errors = _tolerations_errors(old_spec.get("tolerations") or [], new_spec.get("tolerations") or [])
    errors += _deadline_errors(old_spec.get("activeDeadlineSeconds"), new_spec.get("activeDeadlineSeconds"))
    munged = copy.deepcopy(new_spec)
    for field in ("containers", "initContainers"):
        for new, old in zip(munged.get(field) or [], old_spec.get(field) or [], strict=True):
            new["image"] = old.get("image")
    munged["activeDeadlineSeconds"] = old_spec.get("activeDeadlineSeconds")
    munged["tolerations"] = old_spec.get("tolerations")
    if _bare(munged) != _bare(old_spec):
        errors.append(f"spec: Forbidden: pod updates may not change fields other than {UPDATABLE}")
    return errors


def invalid_message(kind: str, name: str, errors: list[str]) -> str:
    """The API server's 422 message for field errors (StatusError of NewInvalid)."""
    listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    return f'{kind} "{name}" is invalid: {listed}'
