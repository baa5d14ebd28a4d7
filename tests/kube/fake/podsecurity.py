"""Pod Security admission, as the API server's PodSecurity plugin enforces it: a namespace's label
`pod-security.kubernetes.io/enforce` names a level (`privileged`, `baseline`, `restricted`; no
label is `privileged`, an unknown value `restricted`), and a pod created there that breaks one of
the level's checks is refused, 403 Forbidden, in the plugin's words:

    pods "x" is forbidden: violates PodSecurity "baseline:latest": hostPath volumes (volume "store")

(the version from `pod-security.kubernetes.io/enforce-version`, default `latest`). Several
violations are listed in the order of their checks' ids, joined by ", ". The checks here:

    baseline    hostPath volumes; privileged containers; hostNetwork, hostPID, hostIPC; hostPorts;
                capabilities added beyond the default set; seccompProfile Unconfined
    restricted  all of baseline, and: volumes of the restricted types only (configMap, csi,
                downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret);
                allowPrivilegeEscalation false; capabilities drop ALL, add at most
                NET_BIND_SERVICE; runAsNonRoot true; runAsUser not 0; seccompProfile
                RuntimeDefault or Localhost

Not modelled: the warn and audit labels, exemptions, AppArmor, SELinux, procMount, sysctls,
Windows host processes, and checks of pod updates (pods are checked when created).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

ENFORCE = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION = "pod-security.kubernetes.io/enforce-version"
LEVELS = ("privileged", "baseline", "restricted")
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
GOOD_SECCOMP = ("RuntimeDefault", "Localhost")

Violation = tuple[str, str]  # (reason, detail)


def policy(namespace_labels: dict[str, str]) -> tuple[str, str]:
    """(level, version) a namespace enforces."""
    level = namespace_labels.get(ENFORCE, "privileged")
    return (level if level in LEVELS else "restricted"), namespace_labels.get(ENFORCE_VERSION, "latest")


def violations(pod_spec: dict, level: str) -> list[Violation]:
    """What `pod_spec` breaks at `level`, in the order of the checks' ids."""
    if level == "privileged":
        return []
    checks = _BASELINE if level == "baseline" else _RESTRICTED
    return [v for _, check in sorted(checks.items()) if (v := check(pod_spec)) is not None]


def refusal(pod_spec: dict, level: str, version: str) -> str | None:
    """The refusal's message after `pods "x" is forbidden: `; None if the pod is admitted."""
    found = violations(pod_spec, level)
    if not found:
        return None
    listed = ", ".join(f"{reason} ({detail})" if detail else reason for reason, detail in found)
    return f'violates PodSecurity "{level}:{version}": {listed}'


# -- helpers, as the plugin words things ---------------------------------------------------------


def _containers(spec: dict) -> Iterator[dict]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(field) or []


def _quoted(names) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _plural(singular: str, plural: str, n: int) -> str:
    return singular if n == 1 else plural


def _who(names: list[str]) -> str:
    return f"{_plural('container', 'containers', len(names))} {_quoted(names)}"


def _context(container: dict) -> dict:
    return container.get("securityContext") or {}


def _pod_context(spec: dict) -> dict:
    return spec.get("securityContext") or {}


# -- baseline -------------------------------------------------------------------------------------


def _host_path_volumes(spec: dict) -> Violation | None:
    bad = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    return ("hostPath volumes", f"{_plural('volume', 'volumes', len(bad))} {_quoted(bad)}") if bad else None


def _privileged(spec: dict) -> Violation | None:
    bad = [c["name"] for c in _containers(spec) if _context(c).get("privileged")]
    return ("privileged", f"{_who(bad)} must not set securityContext.privileged=true") if bad else None


def _host_namespaces(spec: dict) -> Violation | None:
    bad = [f"{f}=true" for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
    return ("host namespaces", ", ".join(bad)) if bad else None


def _host_ports(spec: dict) -> Violation | None:
    bad, ports = [], []
    for c in _containers(spec):
        used = [str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")]
        if used:
            bad.append(c["name"])
            ports += [p for p in used if p not in ports]
    if not bad:
        return None
    uses = _plural("uses", "use", len(bad))
    return "hostPort", f"{_who(bad)} {uses} {_plural('hostPort', 'hostPorts', len(ports))} {', '.join(ports)}"


def _added(container: dict) -> list[str]:
    return list((_context(container).get("capabilities") or {}).get("add") or [])


def _capabilities_baseline(spec: dict) -> Violation | None:
    bad, caps = [], set()
    for c in _containers(spec):
        extra = [cap for cap in _added(c) if cap not in BASELINE_CAPABILITIES]
        if extra:
            bad.append(c["name"])
            caps.update(extra)
    if not bad:
        return None
    return (
        "non-default capabilities",
        f"{_who(bad)} must not include {_quoted(sorted(caps))} in securityContext.capabilities.add",
    )


def _seccomp_type(context: dict) -> str | None:
    return (context.get("seccompProfile") or {}).get("type")


def _seccomp_baseline(spec: dict) -> Violation | None:
    details = []
    if _seccomp_type(_pod_context(spec)) == "Unconfined":
        details.append('pod must not set securityContext.seccompProfile.type to "Unconfined"')
    bad = [c["name"] for c in _containers(spec) if _seccomp_type(_context(c)) == "Unconfined"]
    if bad:
        details.append(f'{_who(bad)} must not set securityContext.seccompProfile.type to "Unconfined"')
    return ("seccompProfile", "; ".join(details)) if details else None


# -- restricted -----------------------------------------------------------------------------------


def _restricted_volumes(spec: dict) -> Violation | None:
    bad, kinds = [], set()
    for volume in spec.get("volumes") or []:
        kind = next((k for k in volume if k != "name"), None)
        if kind is not None and kind not in RESTRICTED_VOLUMES:
            bad.append(volume["name"])
            kinds.add(kind)
    if not bad:
        return None
    n = len(bad)
    return (
        "restricted volume types",
        f"{_plural('volume', 'volumes', n)} {_quoted(bad)} {_plural('uses', 'use', n)} "
        f"{_plural('restricted volume type', 'restricted volume types', len(kinds))} {_quoted(sorted(kinds))}",
    )


def _privilege_escalation(spec: dict) -> Violation | None:
    bad = [c["name"] for c in _containers(spec) if _context(c).get("allowPrivilegeEscalation") is not False]
    if not bad:
        return None
    return (
        "allowPrivilegeEscalation != false",
        f"{_who(bad)} must set securityContext.allowPrivilegeEscalation=false",
    )


def _capabilities_restricted(spec: dict) -> Violation | None:
    no_drop, bad_add, caps = [], [], set()
    for c in _containers(spec):
        if "ALL" not in ((_context(c).get("capabilities") or {}).get("drop") or []):
            no_drop.append(c["name"])
        extra = [cap for cap in _added(c) if cap != "NET_BIND_SERVICE"]
        if extra:
            bad_add.append(c["name"])
            caps.update(extra)
    details = []
    if no_drop:
        details.append(f'{_who(no_drop)} must set securityContext.capabilities.drop=["ALL"]')
    if bad_add:
        details.append(
            f"{_who(bad_add)} must not include {_quoted(sorted(caps))} in securityContext.capabilities.add"
        )
    return ("unrestricted capabilities", "; ".join(details)) if details else None


def _run_as_non_root(spec: dict) -> Violation | None:
    pod = _pod_context(spec).get("runAsNonRoot")
    details = []
    if pod is False:
        details.append("pod must not set securityContext.runAsNonRoot=false")
    explicit = [c["name"] for c in _containers(spec) if _context(c).get("runAsNonRoot") is False]
    if explicit:
        details.append(f"{_who(explicit)} must not set securityContext.runAsNonRoot=false")
    if pod is None:
        implicit = [c["name"] for c in _containers(spec) if _context(c).get("runAsNonRoot") is None]
        if implicit:
            details.append(f"pod or {_who(implicit)} must set securityContext.runAsNonRoot=true")
    return ("runAsNonRoot != true", "; ".join(details)) if details else None


def _run_as_user(spec: dict) -> Violation | None:
    details = []
    if _pod_context(spec).get("runAsUser") == 0:
        details.append("pod must not set runAsUser=0")
    bad = [c["name"] for c in _containers(spec) if _context(c).get("runAsUser") == 0]
    if bad:
        details.append(f"{_who(bad)} must not set runAsUser=0")
    return ("runAsUser=0", "; ".join(details)) if details else None


def _seccomp_restricted(spec: dict) -> Violation | None:
    pod = _seccomp_type(_pod_context(spec))
    details = []
    if pod is not None and pod not in GOOD_SECCOMP:
        details.append(f'pod must not set securityContext.seccompProfile.type to "{pod}"')
    bad_set = [c for c in _containers(spec) if _seccomp_type(_context(c)) not in (None, *GOOD_SECCOMP)]
    if bad_set:
        kinds = sorted({_seccomp_type(_context(c)) for c in bad_set})
        details.append(
            f"{_who([c['name'] for c in bad_set])} must not set securityContext.seccompProfile.type to {_quoted(kinds)}"
        )
    if pod is None:
        implicit = [c["name"] for c in _containers(spec) if _seccomp_type(_context(c)) is None]
        if implicit:
            details.append(
                f'pod or {_who(implicit)} must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"'
            )
    return ("seccompProfile", "; ".join(details)) if details else None


Check = Callable[[dict], Violation | None]
_BASELINE: dict[str, Check] = {  # by the plugin's check ids, whose order the message follows
    "capabilities_baseline": _capabilities_baseline,
    "hostNamespaces": _host_namespaces,
    "hostPathVolumes": _host_path_volumes,
    "hostPorts": _host_ports,
    "privileged": _privileged,
    "seccompProfile_baseline": _seccomp_baseline,
}
_RESTRICTED: dict[str, Check] = {
    **{k: v for k, v in _BASELINE.items() if k not in ("capabilities_baseline", "seccompProfile_baseline")},
    "allowPrivilegeEscalation": _privilege_escalation,
    "capabilities_restricted": _capabilities_restricted,
    "restrictedVolumes": _restricted_volumes,
    "runAsNonRoot": _run_as_non_root,
    "runAsUser": _run_as_user,
    "seccompProfile_restricted": _seccomp_restricted,
}
