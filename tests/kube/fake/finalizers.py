"""What the API server checks of `metadata.finalizers`, in its words (apimachinery's
`ValidateFinalizerName` and `ValidateNoNewFinalizers`, and the core API's standard names):

    every object    each finalizer is a qualified name, `[prefix/]name`: the prefix a DNS subdomain,
                    the name 1 to 63 characters of `[A-Za-z0-9][-A-Za-z0-9_.]*`, ending alphanumeric
                    (`metadata.finalizers: Invalid value: "a b": name part must consist of ...`)
    built-in kinds  a name without a prefix is one of the standard ones (`kubernetes`, `orphan`,
                    `foregroundDeletion`), else `metadata.finalizers[0]: Invalid value: "drain":
                    name is neither a standard finalizer name nor is it fully qualified` (custom
                    resources and CRDs take any bare name: a real server only warns)
    terminating     an update may keep or drop finalizers, never add one: `metadata.finalizers:
                    Forbidden: no new finalizers can be added if the object is being deleted,
                    found new finalizers []string{"x"}`
"""

from __future__ import annotations

import json
import re

STANDARD = frozenset({"kubernetes", "orphan", "foregroundDeletion"})
CRD_CLEANUP = "customresourcecleanup.apiextensions.k8s.io"

_QUALIFIED = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    f"alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '{_QUALIFIED}')"
)
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
    f"must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '{_SUBDOMAIN}')"
)


def qualified_name_errors(value: str) -> list[str]:
    """apimachinery's `IsQualifiedName`: why `value` is not one; empty if it is."""
    parts = value.split("/")
    if len(parts) > 2:
        return [
            f"a qualified name {_QUALIFIED_MSG} with an optional DNS subdomain prefix and '/' "
            "(e.g. 'example.com/MyName')"
        ]
    errors = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            if len(prefix) > 253:
                errors.append("prefix part must be no more than 253 characters")
            if not re.fullmatch(_SUBDOMAIN, prefix):
                errors.append(f"prefix part {_SUBDOMAIN_MSG}")
    name = parts[-1]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    if not re.fullmatch(_QUALIFIED, name):
        errors.append(f"name part {_QUALIFIED_MSG}")
    return errors


def name_errors(finalizers: list[str], *, builtin: bool) -> list[str]:
    """The field errors of an object's finalizers, on create and on update."""
    errors = [
        f"metadata.finalizers: Invalid value: {json.dumps(f)}: {msg}"
        for f in finalizers
        for msg in qualified_name_errors(f)
    ]
    if builtin:
        errors += [
            f"metadata.finalizers[{i}]: Invalid value: {json.dumps(f)}: "
            "name is neither a standard finalizer name nor is it fully qualified"
            for i, f in enumerate(finalizers)
            if "/" not in f and f not in STANDARD
        ]
    return errors


def added_errors(old: list[str], new: list[str]) -> list[str]:
    """The field error of an update that adds finalizers to an object being deleted."""
    extra = sorted(set(new) - set(old))
    if not extra:
        return []
    listed = ", ".join(json.dumps(f) for f in extra)  # Go's %#v of a []string
    return [
        "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, "
        f"found new finalizers []string{{{listed}}}"
    ]
