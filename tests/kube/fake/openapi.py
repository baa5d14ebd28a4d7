"""A custom resource's schema (a CRD version's `openAPIV3Schema`), as the API server applies it.

Four steps, each a function:

    structural_errors  is the schema structural (apiextensions' structural schema rules, below)?
    prune              drop fields the schema does not specify, and null values of fields that are
                       not `nullable` (so a default can take their place); a node with
                       `x-kubernetes-preserve-unknown-fields: true` keeps what it holds
    default            fill each absent field that has a `default`, outside in
    validation_errors  the value validations: type, required, enum, minimum/maximum (with
                       `exclusiveMinimum`/`exclusiveMaximum` as OpenAPI v3.0's booleans),
                       minLength/maxLength, pattern, minItems/maxItems, additionalProperties (a
                       map's values), nullable, and the junctors anyOf/allOf/oneOf/not

Validation is `jsonschema`'s Draft 4, whose boolean exclusive bounds are OpenAPI v3.0's; the
schema is translated first (`nullable: true` adds "null" to the type;
`x-kubernetes-int-or-string` is integer or string). Errors are in the API server's words:
`spec.gpus: Invalid value: 99: spec.gpus in body should be less than or equal to 64`.

The structural rules modelled (apiextensions-apiserver's `structural` package), each error
with the field path of the CRD it is found at:

    every node has a `type`, but where `x-kubernetes-int-or-string: true` (then it has none) or
    `x-kubernetes-preserve-unknown-fields: true` says otherwise; the root's type is `object`
    an array has `items`; `properties` and `additionalProperties` not both; `additionalProperties:
    false` is refused; `$ref` is refused; `x-kubernetes-preserve-unknown-fields` is true or absent
    inside anyOf/allOf/oneOf/not: no type, nullable, default, additionalProperties, title,
    description or x-kubernetes-* extension; every property named there is also specified outside

Not modelled: `format` checks, `x-kubernetes-embedded-resource`, list types and map keys
(`x-kubernetes-list-type`), CEL rules (`x-kubernetes-validations`), the root `metadata` schema
restrictions, defaults validated against their own schema, and ratcheting of unchanged values.
"""

from __future__ import annotations

import copy
import json

import jsonschema

JUNCTORS = ("anyOf", "allOf", "oneOf", "not")
ROOT_FIELDS = ("apiVersion", "kind", "metadata")  # specified implicitly at the root
FORBIDDEN_IN_JUNCTORS = ("type", "nullable", "default", "additionalProperties", "title", "description")


def structural_errors(schema: dict, path: str) -> list[str]:
    """Why `schema` (at `path` in the CRD) is not structural; empty if it is."""
    errors: list[str] = []
    if not schema.get("type") and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors.append(f"{path}.type: Required value: must not be empty at the root")
    elif schema.get("type") not in (None, "object"):
        errors.append(f'{path}.type: Invalid value: "{schema["type"]}": must be object at the root')
    _node(schema, path, errors)
    return errors


def _node(schema: dict, path: str, errors: list[str]) -> None:
    if "$ref" in schema:
        errors.append(f"{path}.$ref: Forbidden: $ref is not supported")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if preserve is not None and preserve is not True:
        errors.append(
            f"{path}.x-kubernetes-preserve-unknown-fields: Invalid value: false: must be true or undefined"
        )
    if schema.get("x-kubernetes-int-or-string"):
        if schema.get("type"):
            errors.append(
                f'{path}.type: Invalid value: "{schema["type"]}": must be empty for x-kubernetes-int-or-string'
            )
    if schema.get("type") == "array" and "items" not in schema:
        errors.append(f"{path}.items: Required value: must be specified")
    extra = schema.get("additionalProperties")
    if extra is not None and "properties" in schema:
        errors.append(
            f"{path}.additionalProperties: Forbidden: additionalProperties and properties are mutual exclusive"
        )
    if extra is False:
        errors.append(f"{path}.additionalProperties: Forbidden: additionalProperties cannot be set to false")
    children = [(f"{path}.properties[{k}]", v) for k, v in (schema.get("properties") or {}).items()]
    if isinstance(schema.get("items"), dict):
        children.append((f"{path}.items", schema["items"]))
    if isinstance(extra, dict):
        children.append((f"{path}.additionalProperties", extra))
    for where, child in children:
        if not child.get("type") and not (
            child.get("x-kubernetes-int-or-string") or child.get("x-kubernetes-preserve-unknown-fields")
        ):
            errors.append(f"{where}.type: Required value: must not be empty for specified object fields")
        _node(child, where, errors)
    for junctor in JUNCTORS:
        for i, nested in enumerate(_nested(schema, junctor)):
            _junctor(schema, nested, f"{path}.{junctor}" + (f"[{i}]" if junctor != "not" else ""), errors)


def _nested(schema: dict, junctor: str) -> list[dict]:
    value = schema.get(junctor)
    if value is None:
        return []
    return [value] if junctor == "not" else list(value)


def _junctor(outer: dict, nested: dict, path: str, errors: list[str]) -> None:
    """A schema under anyOf/allOf/oneOf/not: value validations only, on fields specified outside."""
    for key in FORBIDDEN_IN_JUNCTORS:
        if key in nested:
            errors.append(f"{path}.{key}: Forbidden: must be empty to be structural")
    for key in nested:
        if key.startswith("x-kubernetes-"):
            errors.append(f"{path}.{key}: Forbidden: must be undefined to be structural")
    specified = outer.get("properties") or {}
    for name, child in (nested.get("properties") or {}).items():
        if name not in specified:
            errors.append(f"{path}.properties[{name}]: Required value: must be specified outside the junctor")
        else:
            _junctor(specified[name], child, f"{path}.properties[{name}]", errors)
    if isinstance(nested.get("items"), dict):
        _junctor(outer.get("items") or {}, nested["items"], f"{path}.items", errors)
    for junctor in JUNCTORS:
        for i, deeper in enumerate(_nested(nested, junctor)):
            _junctor(outer, deeper, f"{path}.{junctor}" + (f"[{i}]" if junctor != "not" else ""), errors)


def prune(value: object, schema: dict, *, root: bool = False) -> object:
    """`value` with only what `schema` specifies (a new value; the given one is not changed)."""
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema or root):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        kept = {}
        for key, item in value.items():
            if root and key in ROOT_FIELDS:
                kept[key] = item
            elif key in properties:
                if item is None and not properties[key].get("nullable"):
                    continue  # as the API server drops it, before defaulting
                kept[key] = prune(item, properties[key])
            elif isinstance(extra, dict):
                kept[key] = item if item is None and extra.get("nullable") else prune(item, extra)
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                kept[key] = item
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return value


def default(value: object, schema: dict) -> object:
    """`value` with each absent field that has a `default` given it (a new value)."""
    if isinstance(value, dict):
        result = dict(value)
        for key, child in (schema.get("properties") or {}).items():
            if key not in result and "default" in child:
                result[key] = copy.deepcopy(child["default"])
            if key in result:
                result[key] = default(result[key], child)
        if isinstance(schema.get("additionalProperties"), dict):
            for key in set(result) - set(schema.get("properties") or {}):
                result[key] = default(result[key], schema["additionalProperties"])
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [default(item, schema["items"]) for item in value]
    return value


def validation_errors(obj: dict, schema: dict) -> list[str]:
    """Each value validation `obj` fails, in the API server's words, in the order of their paths."""
    validator = jsonschema.Draft4Validator(_draft4(schema))
    errors = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    return [_message(e) for e in errors]


def _draft4(schema: object) -> object:
    """OpenAPI v3.0 as JSON Schema Draft 4: `nullable` and int-or-string become types."""
    if isinstance(schema, list):
        return [_draft4(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key in ("properties",):
            result[key] = {k: _draft4(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            result[key] = _draft4(value)
        elif key in ("default", "example", "enum") or not key.startswith("x-"):
            result[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        result["type"] = ["integer", "string"]
    if schema.get("nullable") and "type" in result:
        types = result["type"] if isinstance(result["type"], list) else [result["type"]]
        result["type"] = [*types, "null"]
        if "enum" in result:
            result["enum"] = [*result["enum"], None]
    result.pop("nullable", None)
    return result


def _path(parts: object) -> str:
    out = ""
    for part in parts:  # type: ignore[attr-defined]
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shown(value: object) -> str:
    return json.dumps(value)


def _message(error: jsonschema.ValidationError) -> str:
    """kube-openapi's words for one failure, as the API server turns them into field errors."""
    where = _path(error.absolute_path)
    value, rule, bound = error.instance, error.validator, error.validator_value
    schema = error.schema
    if rule == "required":
        missing = next(k for k in bound if k not in value)
        return f"{_path([*error.absolute_path, missing])}: Required value"
    if rule == "type":
        wanted = bound if isinstance(bound, str) else next(t for t in bound if t != "null")
        names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer"}
        shown = "null" if value is None else names.get(type(value), "number")
        return f'{where}: Invalid value: "{shown}": {where} in body must be of type {wanted}: "{shown}"'
    if rule == "enum":
        allowed = ", ".join(_shown(v) for v in bound if v is not None)
        return f"{where}: Unsupported value: {_shown(value)}: supported values: {allowed}"
    if rule in ("maximum", "minimum"):
        exclusive = schema.get("exclusiveMaximum" if rule == "maximum" else "exclusiveMinimum")
        side = "less" if rule == "maximum" else "greater"
        than = f"{side} than" if exclusive else f"{side} than or equal to"
        return f"{where}: Invalid value: {_shown(value)}: {where} in body should be {than} {bound}"
    if rule == "maxLength":
        return f"{where}: Too long: may not be more than {bound} bytes"
    if rule == "minLength":
        return (
            f"{where}: Invalid value: {_shown(value)}: {where} in body should be at least {bound} chars long"
        )
    if rule == "pattern":
        return f"{where}: Invalid value: {_shown(value)}: {where} in body should match '{bound}'"
    if rule == "maxItems":
        return f"{where}: Too many: {len(value)}: must have at most {bound} items"
    if rule == "minItems":
        return f"{where}: Invalid value: {len(value)}: {where} in body should have at least {bound} items"
    return f"{where or '<root>'}: Invalid value: {_shown(value)}: {error.message}"
