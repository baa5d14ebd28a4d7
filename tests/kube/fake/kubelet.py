"""A kubelet for the tests: runs the pods the fake API server bound to its nodes as local processes.

It is a client of the API like the real one (lightkube, its own token, unrestricted: the fake
models no Node authorizer): it watches pods, runs each bound pod's init containers in order and
then its container, probes readiness, and reports back through `pods/<name>/status` with
strategic merge patches, as a kubelet does: phase, podIP, conditions (Initialized,
ContainersReady, Ready; PodScheduled is the scheduler's) and container statuses. Init containers
keep theirs once they ended (`terminated`: Completed with exit code 0, or Error with its code);
while they run, those after them and the container wait (`PodInitializing`). A deleted pod's
processes get SIGTERM, SIGKILL after the grace period, and the pod is then deleted with grace 0.

What differs from a node, and why it keeps the tests honest:

- No images: a container's `command[0]` is looked up in `programs` (`stoker` → the repository's
  `.venv/bin/stoker`); one not there fails as a missing executable does (StartError, exit 128).
- The network: each pod gets its own loopback address 127.a.b.c (Linux routes all of 127/8 to
  lo), so every pod's engine listens on the same fixed port, as in a pod. Inside a pod 0.0.0.0
  means the pod's own addresses; here an argument `0.0.0.0` is rewritten to the pod's address.
- Files: no mount namespaces; a hostPath volume is read at its own path, so the tests mount the
  store at the path it has on the host (as the backend does: `store_path` on node and in pod). A
  Secret volume's items are written to a directory of the pod's own (with the volume's
  defaultMode), and an argument naming a file under its mountPath is rewritten to name it there.
- Probes: an HTTPS probe does not verify the certificate, as a kubelet's does not.
- Environment: `base_env` (PATH, HOME, the test's offline switches) plus the container's `env`,
  with `secretKeyRef` values read from the API as a kubelet does.
- Logs: each container's output goes to `<log_dir>/<ns>_<pod>_<container>.log`, which the fake
  API server serves as `pods/log`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod, PodStatus, Secret
from lightkube.types import PatchType

from tests.kube.fake.apiserver import now_iso


@dataclass
class _Run:
    """One pod this kubelet runs."""

    name: str
    uid: str
    spec: dict
    ip: str
    process: asyncio.subprocess.Process | None = None
    terminating: bool = False
    task: asyncio.Task | None = None
    terminator: asyncio.Task | None = None
    conditions: dict[str, str] = field(default_factory=dict)


class ContainerFailed(Exception):
    def __init__(self, reason: str, message: str, exit_code: int = 128) -> None:
        super().__init__(message)
        self.reason, self.message, self.exit_code = reason, message, exit_code


def pick_address(ports: list[int]) -> str:
    """A loopback address of its own for a pod, on which all its container ports are free."""
    while True:
        ip = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(2, 254)}"
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return ip


class FakeKubelet:
    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        nodes: set[str],
        *,
        programs: Mapping[str, str],
        base_env: Mapping[str, str],
        log_dir: Path,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.nodes = nodes
        self.programs = dict(programs)
        self.base_env = dict(base_env)
        self.log_dir = log_dir
        self.runs: dict[str, _Run] = {}  # by pod uid
        self.errors: list[BaseException] = []  # what broke in this kubelet: the tests assert none

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        task.add_done_callback(
            lambda t: t.cancelled() or t.exception() is None or self.errors.append(t.exception())
        )
        return task

    async def run(self) -> None:
        """Watch pods until cancelled; then stop everything this kubelet started."""
        try:
            while True:
                try:
                    async for event, pod in self.client.watch(Pod, namespace=self.namespace):
                        self._on_event(event, pod.to_dict())
                except ApiError as exc:
                    if exc.status.code != 410:
                        raise
                    # Too old: watch again from now; the current pods come as ADDED, known ones by uid.
        finally:
            for run in self.runs.values():
                if run.process is not None and run.process.returncode is None:
                    _killpg(run.process.pid, signal.SIGKILL)
                for task in (run.task, run.terminator):
                    if task is not None:
                        task.cancel()

    def _on_event(self, event: str, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        if event == "DELETED" or spec.get("nodeName") not in self.nodes:
            return
        run = self.runs.get(uid)
        if run is None:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return
            ports = [p["containerPort"] for c in spec["containers"] for p in c.get("ports") or []]
            run = _Run(meta["name"], uid, spec, pick_address(ports))
            self.runs[uid] = run
            run.task = self._track(asyncio.create_task(self._lifecycle(run)))
        if meta.get("deletionTimestamp") and not run.terminating:
            run.terminating = True
            run.terminator = asyncio.create_task(
                self._terminate(run, meta.get("deletionGracePeriodSeconds", 30))
            )

    async def _lifecycle(self, run: _Run) -> None:
        """Init containers in order, then the container: run, probe, report its end. Every init
        container's status is kept once it ended (`terminated`, Completed with 0 or Error with its
        code), as a kubelet keeps them; those not yet run, and the container, wait meanwhile."""
        started = now_iso()
        container = run.spec["containers"][0]
        inits = run.spec.get("initContainers") or []
        statuses = [_waiting(init, "PodInitializing") for init in inits]
        held = [_waiting(container, "PodInitializing")]
        for i, init in enumerate(inits):
            statuses[i] = _running(init, now_iso())
            await self._patch(run, initContainerStatuses=statuses, containerStatuses=held)
            began = now_iso()
            code, reason, message = await self._run_to_end(run, init)
            statuses[i] = _terminated(init, code, reason, began, message)
            if code != 0:
                await self._patch(run, phase="Failed", initContainerStatuses=statuses, containerStatuses=held)
                return
        if inits:
            await self._patch(run, initContainerStatuses=statuses)
        await self._set(run, Initialized="True")
        try:
            run.process = await self._spawn(run, container)
        except ContainerFailed as exc:
            status = _terminated(container, exc.exit_code, exc.reason, started, exc.message)
            await self._patch(run, phase="Failed", containerStatuses=[status])
            return
        running = _running(container, started)
        running.update(started=True)
        await self._patch(
            run,
            phase="Running",
            podIP=run.ip,
            podIPs=[{"ip": run.ip}],
            hostIP="127.0.0.1",
            startTime=started,
            containerStatuses=[running],
        )
        probe = asyncio.create_task(self._probe(run, container))
        code = await run.process.wait()
        probe.cancel()
        await self._set(run, Ready="False", ContainersReady="False")
        status = _terminated(container, code, "Completed" if code == 0 else "Error", started)
        await self._patch(run, phase="Succeeded" if code == 0 else "Failed", containerStatuses=[status])

    async def _run_to_end(self, run: _Run, container: dict) -> tuple[int, str, str | None]:
        """(exit code, reason, message) of a container run to its end."""
        try:
            run.process = await self._spawn(run, container)
        except ContainerFailed as exc:
            return exc.exit_code, exc.reason, exc.message
        code = await run.process.wait()
        return code, "Completed" if code == 0 else "Error", None

    async def _spawn(self, run: _Run, container: dict) -> asyncio.subprocess.Process:
        if run.terminating:
            raise ContainerFailed("Error", "the pod is being deleted", 137)
        command = container.get("command") or []
        program = self.programs.get(command[0]) if command else None
        if program is None:
            raise ContainerFailed(
                "StartError", f'exec: "{command[0] if command else ""}": executable file not found in $PATH'
            )
        args = [run.ip if a == "0.0.0.0" else a for a in [*command[1:], *(container.get("args") or [])]]
        for mount_path, where in (await self._secret_volumes(run, container)).items():
            args = [where + a[len(mount_path) :] if a.startswith(mount_path + "/") else a for a in args]
        env = {**self.base_env, **await self._env(container)}
        log = self.log_dir / f"{self.namespace}_{run.name}_{container['name']}.log"
        with log.open("ab") as out:
            return await asyncio.create_subprocess_exec(
                program,
                *args,
                env=env,
                cwd=container.get("workingDir"),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )

    async def _env(self, container: dict) -> dict[str, str]:
        """`envFrom` secrets first, then `env` (which wins), secret values read from the API."""
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            env.update(await self._secret((source.get("secretRef") or {}).get("name", "")))
        for var in container.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                env[var["name"]] = var.get("value", "")
            else:
                env[var["name"]] = (await self._secret(ref["name"]))[ref["key"]]
        return env

    async def _secret_volumes(self, run: _Run, container: dict) -> dict[str, str]:
        """Each Secret volume the container mounts, written out: its mountPath → the directory."""
        volumes = {v["name"]: v for v in run.spec.get("volumes") or [] if "secret" in v}
        out = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                continue
            source = volume["secret"]
            data = await self._secret(source["secretName"])
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            where = self.log_dir / "volumes" / f"{self.namespace}_{run.name}" / mount["name"]
            where.mkdir(parents=True, exist_ok=True)
            for item in items:
                if item["key"] not in data:
                    raise ContainerFailed("CreateContainerConfigError", f"secret has no key {item['key']!r}")
                path = where / item["path"]
                path.write_text(data[item["key"]])
                path.chmod(source.get("defaultMode", 0o644))
            out[mount["mountPath"].rstrip("/")] = str(where)
        return out

    async def _secret(self, name: str) -> dict[str, str]:
        try:
            secret = await self.client.get(Secret, name, namespace=self.namespace)
        except ApiError as exc:
            raise ContainerFailed("CreateContainerConfigError", f'secret "{name}" not found') from exc
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    async def _probe(self, run: _Run, container: dict) -> None:
        """The readiness probe: httpGet every periodSeconds; Ready follows its last answer."""
        probe = container.get("readinessProbe") or {}
        get = probe.get("httpGet")
        if get is None:
            await self._set(run, Ready="True", ContainersReady="True")
            return
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container["ports"] if p.get("name") == port)
        scheme = get.get("scheme", "HTTP").lower()
        url = f"{scheme}://{run.ip}:{port}{get.get('path', '/')}"
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        # ssl=False: a kubelet's HTTPS probe does not verify the certificate (the pool's calls do)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as session:
            while True:
                try:
                    timeout = aiohttp.ClientTimeout(total=probe.get("timeoutSeconds", 1))
                    async with session.get(url, timeout=timeout) as r:
                        ready = 200 <= r.status < 400
                except (aiohttp.ClientError, TimeoutError):
                    ready = False
                state = "True" if ready else "False"
                if run.conditions.get("Ready") != state:
                    await self._set(run, Ready=state, ContainersReady=state)
                await asyncio.sleep(probe.get("periodSeconds", 10))

    async def _terminate(self, run: _Run, grace_s: int) -> None:
        """SIGTERM, SIGKILL after the grace period, wait for the lifecycle to report, delete for good."""
        process = run.process
        if process is not None and process.returncode is None:
            _killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                _killpg(process.pid, signal.SIGKILL)
        if run.task is not None:
            with contextlib.suppress(Exception):
                await run.task
        with contextlib.suppress(ApiError):
            await self.client.delete(Pod, run.name, namespace=self.namespace, grace_period=0)

    async def _set(self, run: _Run, **conditions: str) -> None:
        run.conditions.update(conditions)
        await self._patch(run)

    async def _patch(self, run: _Run, **status: object) -> None:
        """A strategic merge patch of the pod's status, as a kubelet sends: the conditions it sets
        merge with the others by type; the container status lists it sends replace theirs."""
        at = now_iso()
        conditions = [{"type": t, "status": s, "lastTransitionTime": at} for t, s in run.conditions.items()]
        body = {"status": {**status, "conditions": conditions}}
        with contextlib.suppress(ApiError):  # the pod may be gone already
            await self.client.patch(
                PodStatus, run.name, body, namespace=self.namespace, patch_type=PatchType.STRATEGIC
            )


def _status(container: dict, state: dict) -> dict:
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "state": state,
    }


def _waiting(container: dict, reason: str) -> dict:
    return _status(container, {"waiting": {"reason": reason}})


def _running(container: dict, started: str) -> dict:
    return _status(container, {"running": {"startedAt": started}})


def _terminated(container: dict, code: int, reason: str, started: str, message: str | None = None) -> dict:
    state = {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now_iso()}
    if message:
        state["message"] = message
    return _status(container, {"terminated": state})


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
