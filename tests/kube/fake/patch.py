"""The two patch formats the fake API server applies, as the API server applies them.

`merge_patch` is JSON merge patch (RFC 7386, `application/merge-patch+json`): maps merge, null
removes a key, anything else (lists included) replaces what was there.

`strategic_merge_patch` is Kubernetes' strategic merge patch
(`application/strategic-merge-patch+json`), for built-in kinds only (the API server refuses it for
custom resources): a list whose field is tagged `patchStrategy: merge` is merged, not replaced:
by its `patchMergeKey` (`metadata.ownerReferences` by `uid`, `spec.containers` and `env` by
`name`, `status.conditions` by `type`), or, for a list of scalars (`metadata.finalizers`), as a
union. Other lists replace. The tags are read from the official OpenAPI schema
(`tests.kube.fake.schema`: `x-kubernetes-patch-strategy`, `x-kubernetes-patch-merge-key`),
the same ones the API server's Go structs carry, so every built-in kind merges as on a cluster.

Directives, as apimachinery's strategicpatch applies them:

    {"$patch": "replace", ...}       in a map: the map becomes the rest of the patch
    {"$patch": "delete"}             in a map: the map goes; in a merged list, with the merge
                                     key: that element goes
    [{"$patch": "replace"}, a, b]    in a merged list: the list becomes [a, b]
    "$deleteFromPrimitiveList/f": [x]  removes x from the scalar list f
    "$setElementOrder/f": [...]      the order of the merged list f (by merge key, or the values)
    "$retainKeys": [k, ...]          keys of the map other than these go (`retainKeys` strategy)

Pure: the original is never changed.
"""

from __future__ import annotations

import copy

from tests.kube.fake.schema import definitions

_PATCH = "$patch"
_DELETE_FROM = "$deleteFromPrimitiveList/"
_ORDER = "$setElementOrder/"
_RETAIN = "$retainKeys"


class PatchError(ValueError):
    """A patch the API server would refuse to apply (a merged list element without its key)."""


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386: maps merge recursively, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _resolve(schema: dict | None) -> dict | None:
    while schema is not None and "$ref" in schema:
        schema = definitions()[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _field(schema: dict | None, key: str) -> dict | None:
    """The schema of field `key` of an object schema, unresolved (its patch tags are on it)."""
    schema = _resolve(schema)
    if schema is None:
        return None
    if key in (schema.get("properties") or {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def strategic_merge_patch(original: dict, patch: dict, type_name: str) -> dict:
    """`patch` applied to `original`, an object of the OpenAPI type `type_name`. PatchError if the
    patch cannot be applied."""
    if not isinstance(patch, dict):
        raise PatchError("a strategic merge patch must be a JSON object")
    merged = _merge_map(copy.deepcopy(original), patch, {"$ref": f"#/$defs/{type_name}"})
    return merged if merged is not None else {}


def _merge_map(original: dict, patch: dict, schema: dict | None) -> dict | None:
    """The merged map; None if the patch deletes it."""
    directive = patch.get(_PATCH)
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip(patch, schema)
    if directive not in (None, "merge"):
        raise PatchError(f"unknown patch directive {directive!r}")
    result = dict(original)
    orders: dict[str, list] = {}
    for key, value in patch.items():
        if key.startswith(_DELETE_FROM):
            name = key[len(_DELETE_FROM) :]
            result[name] = [v for v in result.get(name) or [] if v not in value]
        elif key.startswith(_ORDER):
            orders[key[len(_ORDER) :]] = value
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        field = _field(schema, key)
        if value is None:
            result.pop(key, None)
        elif key not in result or result[key] is None:
            result[key] = _strip(value, field)
        elif isinstance(value, dict) and isinstance(result[key], dict):
            merged = _merge_map(result[key], value, field)
            if merged is None:
                del result[key]
            else:
                result[key] = merged
        elif isinstance(value, list) and isinstance(result[key], list):
            result[key] = _merge_list(result[key], value, field)
        else:
            result[key] = _strip(value, field)
    for name, order in orders.items():
        if isinstance(result.get(name), list):
            result[name] = _ordered(result[name], order, _merge_key(_field(schema, name)))
    if _RETAIN in patch:
        result = {k: v for k, v in result.items() if k in patch[_RETAIN]}
    return result


def _strategy(schema: dict | None) -> tuple[bool, str | None]:
    """(merge, merge key) from a list field's tags."""
    if schema is None:
        return False, None
    strategy = schema.get("x-kubernetes-patch-strategy", "")
    return "merge" in strategy.split(","), schema.get("x-kubernetes-patch-merge-key")


def _merge_key(schema: dict | None) -> str | None:
    return _strategy(schema)[1]


def _merge_list(original: list, patch: list, schema: dict | None) -> list:
    merge, key = _strategy(schema)
    items = (schema or {}).get("items")
    if not merge:
        return _strip(patch, schema)
    if key is None:  # a list of scalars merged as a set: what the patch adds, appended
        return [*original, *(v for v in patch if v not in original)]
    if any(isinstance(p, dict) and p.get(_PATCH) == "replace" for p in patch):
        return [_strip(p, items) for p in patch if not (isinstance(p, dict) and _PATCH in p)]
    result = list(original)
    for element in patch:
        if not isinstance(element, dict) or key not in element:
            raise PatchError(f"a patch element {element!r:.80} does not contain its merge key {key!r}")
        at = next(
            (i for i, o in enumerate(result) if isinstance(o, dict) and o.get(key) == element[key]), None
        )
        if element.get(_PATCH) == "delete":
            result = [o for o in result if not (isinstance(o, dict) and o.get(key) == element[key])]
        elif at is None:
            result.append(_strip(element, items))
        else:
            merged = _merge_map(result[at], element, items)
            if merged is None:
                del result[at]
            else:
                result[at] = merged
    return result


def _ordered(values: list, order: list, key: str | None) -> list:
    """`values` in the order `$setElementOrder` gives; those it does not name keep theirs, after."""
    ident = (lambda v: v.get(key) if isinstance(v, dict) else v) if key else (lambda v: v)
    wanted = [ident(o) for o in order]
    named = sorted((v for v in values if ident(v) in wanted), key=lambda v: wanted.index(ident(v)))
    return named + [v for v in values if ident(v) not in wanted]


def _strip(value: object, schema: dict | None) -> object:
    """A new value with the directives taken out (a new field's patch is its value)."""
    if isinstance(value, dict):
        if value.get(_PATCH) == "delete":
            return None
        return {
            k: _strip(v, _field(schema, k))
            for k, v in value.items()
            if not k.startswith("$") and v is not None
        }
    if isinstance(value, list):
        items = (schema or {}).get("items")
        return [
            _strip(v, items)
            for v in value
            if not (isinstance(v, dict) and v.get(_PATCH) in ("delete", "replace"))
        ]
    return copy.deepcopy(value)
