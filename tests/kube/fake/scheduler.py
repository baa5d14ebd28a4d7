"""Where a pod goes: kube-scheduler's default filters, in its order, and a score, as pure functions.

A node is filtered out by the first of these it fails (its reason is counted for the message):

    NodeUnschedulable  `spec.unschedulable` and no toleration of it    node(s) were unschedulable
    TaintToleration    a NoSchedule or NoExecute taint not tolerated   node(s) had untolerated taint {k: v}
    NodeAffinity       `nodeSelector`, or no required term matches     node(s) didn't match Pod's node affinity/selector
    NodeResourcesFit   the pod's requests exceed what is left of the   Insufficient nvidia.com/gpu (one reason per
                       node's `status.allocatable` after the requests  resource short), Too many pods
                       of the pods bound there and not terminated

A toleration matches a taint when its effect is empty or the same, and its operator is Exists
(with an empty key: every taint) or Equal (the default) with the same key and value. Node
affinity terms are ORed, a term's expressions ANDed (In, NotIn, Exists, DoesNotExist, Gt and Lt
on integers; `matchFields` on metadata.name); a term with no expressions matches nothing. A pod's
request of a resource is the sum of its containers' (a limit without a request counts as the
request, as the API server defaults it), or the largest init container's if that is more.

The nodes left are scored by the summed weights of the preferred affinity terms they match, ties
broken by name (the real scorer adds resource balance and spreading: not modelled). None left:

    0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint {dedicated: gpu}.

(the reasons counted over the nodes, sorted; the preemption postscript is left out).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$")
_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{s: Fraction(1024**i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
}


def quantity(text: str | int | float) -> Fraction:
    """A resource quantity (`250m`, `2`, `512Mi`, `1e3`) as an exact number."""
    m = _QUANTITY.match(str(text).strip())
    if m is None:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY.pattern!r}, got {text!r}")
    number, exponent, suffix = m.groups()
    value = Fraction(number)
    if exponent:
        value *= Fraction(10) ** int(exponent[1:])
    return value * _SUFFIX[suffix] if suffix else value


def _container_requests(container: dict) -> dict[str, Fraction]:
    resources = container.get("resources") or {}
    both = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: quantity(q) for name, q in both.items()}


def pod_requests(spec: dict) -> dict[str, Fraction]:
    """What the pod asks of its node, per resource, plus one of `pods`."""
    total: Counter = Counter()
    for container in spec.get("containers") or []:
        total.update(_container_requests(container))
    for init in spec.get("initContainers") or []:
        for name, q in _container_requests(init).items():
            total[name] = max(total[name], q)
    total["pods"] += 1
    return dict(total)


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        operator = t.get("operator") or "Equal"
        if operator == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if (
            operator == "Equal"
            and t.get("key") == taint["key"]
            and (t.get("value") or "") == (taint.get("value") or "")
        ):
            return True
    return False


def _expression(values_of: dict, expr: dict) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    present = key in values_of
    if op == "In":
        return present and values_of[key] in values
    if op == "NotIn":
        return not present or values_of[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt"):
        try:
            have, bound = int(values_of[key]), int(values[0])
        except (KeyError, ValueError, IndexError):
            return False
        return have > bound if op == "Gt" else have < bound
    raise ValueError(f"unknown node selector operator {op!r}")


def term_matches(node: dict, term: dict) -> bool:
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    expressions = [(labels, e) for e in term.get("matchExpressions") or []]
    expressions += [(fields, e) for e in term.get("matchFields") or []]
    return bool(expressions) and all(_expression(values, e) for values, e in expressions)


def _affinity(spec: dict) -> dict:
    return (spec.get("affinity") or {}).get("nodeAffinity") or {}


def _untolerated_taint(spec: dict, node: dict) -> str | None:
    tolerations = spec.get("tolerations") or []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint["effect"] in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
    return None


def _matches_selector(spec: dict, node: dict) -> bool:
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (_affinity(spec).get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get(
        "nodeSelectorTerms"
    )
    return not required or any(term_matches(node, t) for t in required)


def _short(spec: dict, node: dict, bound: list[dict]) -> list[str]:
    """NodeResourcesFit's reasons: each resource the pod asks more of than the node has left."""
    allocatable = {k: quantity(v) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()}
    used: Counter = Counter()
    for pod in bound:
        used.update(pod_requests(pod["spec"]))
    reasons = []
    for name, wanted in sorted(pod_requests(spec).items()):
        if wanted > 0 and wanted > allocatable.get(name, Fraction(0)) - used[name]:
            reasons.append("Too many pods" if name == "pods" else f"Insufficient {name}")
    return reasons


def filter_reasons(spec: dict, node: dict, bound: list[dict]) -> list[str]:
    """Why the pod cannot go to `node` (the first failing filter's reasons); [] if it can."""
    if (node.get("spec") or {}).get("unschedulable"):
        taint = {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}
        if not tolerates(spec.get("tolerations") or [], taint):
            return ["node(s) were unschedulable"]
    if (taint := _untolerated_taint(spec, node)) is not None:
        return [taint]
    if not _matches_selector(spec, node):
        return ["node(s) didn't match Pod's node affinity/selector"]
    return _short(spec, node, bound)


@dataclass(frozen=True)
class Decision:
    node: str | None
    message: str = ""  # why none, in the scheduler's words


def schedule(spec: dict, nodes: list[dict], bound: dict[str, list[dict]]) -> Decision:
    """The node for a pod with `spec`, given the nodes and the live pods bound to each by name."""
    if not nodes:
        return Decision(None, "no nodes available to schedule pods")
    preferred = _affinity(spec).get("preferredDuringSchedulingIgnoredDuringExecution") or []
    reasons: Counter = Counter()
    best: tuple[int, str] | None = None
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        failed = filter_reasons(spec, node, bound.get(name, []))
        if failed:
            reasons.update(failed)
            continue
        score = sum(p["weight"] for p in preferred if term_matches(node, p["preference"]))
        if best is None or score > best[0]:
            best = (score, name)
    if best is not None:
        return Decision(best[1])
    listed = ", ".join(sorted(f"{n} {reason}" for reason, n in reasons.items()))
    return Decision(None, f"0/{len(nodes)} nodes are available: {listed}.")
