"""A container's environment and argv as the kubelet computes them.

Order: the service variables (only the API server's: KUBERNETES_SERVICE_HOST/PORT), then `envFrom`
(configMapRef/secretRef, with prefix), then `env` in order; `value` and argv expand `$(NAME)` from what
is defined so far (`$$` escapes, unknown names stay as written); `valueFrom` takes a fieldRef
(metadata.name/namespace/uid/labels['k']/annotations['k'], spec.nodeName, spec.serviceAccountName,
status.podIP(s), status.hostIP(s)), a resourceFieldRef (limits/requests cpu or memory), a
secretKeyRef or a configMapKeyRef (`optional` honoured). Anything else is refused by name with
`ConfigError`, which the runner reports as CreateContainerConfigError.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kubernetes.utils.quantity import parse_quantity

# (kind, namespace, name) -> the object's data (Secrets decoded), or None when it does not exist.
Lookup = Callable[[str, str, str], dict[str, bytes] | None]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_INDEXED = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class ConfigError(ValueError):
    """The container cannot be configured (missing Secret key, unsupported field): the reason, by name."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(repl, text)


def field_value(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", [])),
        "status.hostIP": status.get("hostIP", ""),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", [])),
    }
    if path in simple:
        return simple[path]
    if m := _INDEXED.match(path):
        return meta.get(m.group(1), {}).get(m.group(2), "")
    raise ConfigError(f"fieldRef {path!r} is not supported by the pod runner")


def resource_value(container: dict[str, Any], ref: dict[str, Any]) -> str:
    kind, _, resource = ref["resource"].partition(".")
    value = container.get("resources", {}).get(kind, {}).get(resource)
    if resource not in ("cpu", "memory") or kind not in ("limits", "requests"):
        raise ConfigError(f"resourceFieldRef {ref['resource']!r} is not supported by the pod runner")
    divisor = parse_quantity(ref.get("divisor", "1"))
    if value is None:
        return "0"
    quotient = parse_quantity(value) / divisor
    return str(int(-(-quotient // 1)))  # the kubelet rounds up


def _keyed(lookup: Lookup, kind: str, namespace: str, ref: dict[str, Any]) -> str | None:
    data = lookup(kind, namespace, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        what = "not found" if data is None else f"has no key {ref['key']!r}"
        raise ConfigError(f"{kind} {namespace}/{ref['name']} {what}")
    return data[ref["key"]].decode(errors="replace")


def container_env(
    pod: dict[str, Any], container: dict[str, Any], lookup: Lookup, service_env: dict[str, str]
) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env = dict(service_env)
    for source in container.get("envFrom", []):
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                data = lookup(kind, namespace, source[key]["name"])
                if data is None and not source[key].get("optional"):
                    raise ConfigError(f"{kind} {namespace}/{source[key]['name']} not found (envFrom)")
                env.update(
                    {
                        source.get("prefix", "") + k: v.decode(errors="replace")
                        for k, v in (data or {}).items()
                    }
                )
    for var in container.get("env", []):
        name, value_from = var["name"], var.get("valueFrom")
        if value_from is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in value_from:
            env[name] = field_value(pod, value_from["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in value_from:
            env[name] = resource_value(container, value_from["resourceFieldRef"])
        elif "secretKeyRef" in value_from or "configMapKeyRef" in value_from:
            kind, ref = (
                ("Secret", value_from["secretKeyRef"])
                if "secretKeyRef" in value_from
                else ("ConfigMap", value_from["configMapKeyRef"])
            )
            value = _keyed(lookup, kind, namespace, ref)
            if value is not None:
                env[name] = value
        else:
            raise ConfigError(
                f"env {name}: valueFrom {sorted(value_from)} is not supported by the pod runner"
            )
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOSTNAME", pod["spec"].get("hostname") or pod["metadata"]["name"])
    return env


def container_argv(
    container: dict[str, Any], env: dict[str, str], entrypoint: list[str], cmd: list[str]
) -> list[str]:
    """As a container runtime combines them: `command` replaces the image's ENTRYPOINT (and drops its
    CMD), `args` replace CMD; $(VAR) expanded in command and args, never in the image's own."""
    command, args = container.get("command"), container.get("args")
    head = [expand(a, env) for a in command] if command else list(entrypoint)
    tail = [expand(a, env) for a in args] if args is not None else ([] if command else list(cmd))
    if not head and not tail:
        raise ConfigError(f"container {container['name']}: no command, and its image has no entrypoint here")
    return head + tail
