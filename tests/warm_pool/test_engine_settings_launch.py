"""A deployment's engine settings in the command that starts its instances: N devices acquired and
released together (vLLM's tensor parallel), vLLM's settings by vLLM's names, Stoker's engine on CUDA
where it was given a device."""

from __future__ import annotations

import pytest

from snapshots import SnapshotStore, import_hf_dir
from warm_pool.engine_settings import EngineSettings
from warm_pool.errors import NoGpuAvailable
from warm_pool.instances import InstanceOps, InstanceSettings
from warm_pool.launch import GpuInventory, cpu_engine_spec
from warm_pool.snapshot import SnapshotSource
from warm_pool.states import Instance
from warm_pool.vllm import VllmLaunch, VllmRuntime

GPU_BUILD = VllmLaunch(VllmRuntime(("vllm",), "0.32.0"), ("--seed=1",))


@pytest.fixture
def source(tmp_path, tiny_model_dir) -> SnapshotSource:
    store = SnapshotStore(tmp_path / "store")
    return SnapshotSource(store, import_hf_dir(tiny_model_dir, store).id)


def ops_for(source, engine: str, settings: EngineSettings, gpus: GpuInventory) -> InstanceOps:
    launch = GPU_BUILD if engine == "vllm" else None
    s = InstanceSettings("big", source, engine, 30.0, 8, 300.0, 10.0, "127.0.0.1", None, launch, settings)
    return InstanceOps(s, backend=None, engines=object(), gpus=gpus)


def instance(n: int) -> Instance:
    return Instance(f"big-0000000{n}", "big", 0.0, 8, port=8000 + n, secret="k")


async def test_vllm_takes_its_gpus_together_with_tensor_parallel_and_its_settings(source):
    settings = EngineSettings(
        gpus=2,
        dtype="bfloat16",
        max_model_len=8192,
        max_num_seqs=32,
        enforce_eager=True,
        engine_args=("--x=1",),
    )
    inventory = GpuInventory([0, 1, 2])
    ops = ops_for(source, "vllm", settings, inventory)
    spec = await ops._spec(instance(1), source.path)
    args = " ".join(spec.argv)
    assert "--tensor-parallel-size 2" in args and spec.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "--dtype bfloat16" in args and "--max-model-len 8192" in args
    # The deployment's, then the operator's --vllm-args (last, they win).
    assert args.endswith("--max-num-seqs 32 --enforce-eager --x=1 --seed=1")
    assert inventory.held_by("big-00000001") == [0, 1]
    # Two at once or none: one GPU left is not enough for a second instance.
    with pytest.raises(NoGpuAvailable, match="needs 2 GPUs, 1 free of 3"):
        await ops._spec(instance(2), source.path)
    assert inventory.held_by("big-00000002") == []
    await ops.stop(instance(1))  # both released together
    assert inventory.free() == [0, 1, 2]


async def test_vllm_without_a_gpu_count_takes_one_and_the_snapshots_dtype(source):
    ops = ops_for(source, "vllm", EngineSettings(), GpuInventory([3]))
    spec = await ops._spec(instance(1), source.path)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "3" and "--tensor-parallel-size" not in spec.argv
    assert spec.argv[spec.argv.index("--dtype") + 1] == "float32"  # the tiny model's, from its manifest


async def test_stokers_engine_given_a_gpu_runs_with_device_auto_on_it(source):
    inventory = GpuInventory([0, 1])
    ops = ops_for(source, "cpu", EngineSettings(gpus=1, dtype="bfloat16", max_model_len=512), inventory)
    spec = await ops._spec(instance(1), source.path)
    assert spec.argv[spec.argv.index("--device") + 1] == "auto" and spec.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "--dtype bfloat16" in " ".join(spec.argv) and "--max-model-len 512" in " ".join(spec.argv)
    on_cpu = await ops_for(source, "cpu", EngineSettings(), GpuInventory([0]))._spec(instance(2), source.path)
    assert (
        on_cpu.argv[on_cpu.argv.index("--device") + 1] == "cpu" and "CUDA_VISIBLE_DEVICES" not in on_cpu.env
    )
    with pytest.raises(ValueError, match="one device"):
        cpu_engine_spec(source.path, 8000, "big", gpus=[0, 1])


async def test_in_a_pod_vllm_is_the_images_and_the_pod_decides_its_build(source):
    from warm_pool.backends.kube_pod import PodGpus
    from warm_pool.vllm import IMAGE_VLLM

    launch = VllmLaunch(IMAGE_VLLM, ("--seed=1",))
    settings = EngineSettings(gpus=2, max_model_len=8192, dtype="bfloat16", enforce_eager=True)
    s = InstanceSettings("big", source, "vllm", 30.0, 8, 300.0, 10.0, "0.0.0.0", None, launch, settings)
    ops = InstanceOps(s, backend=None, engines=object(), gpus=PodGpus())
    spec = await ops._spec(instance(1), source.path)
    assert (spec.program, spec.args[0]) == ("stoker", "vllm-serve") and spec.secret_env == {"VLLM_API_KEY"}
    args = " ".join(spec.args)
    assert "--gpus 2 --dtype bfloat16" in args and "--max-model-len 8192" in args
    assert args.endswith("-- --enforce-eager --seed=1") and "CUDA_VISIBLE_DEVICES" not in spec.env


async def test_stokers_engine_takes_its_adapter_settings_as_its_own_flags(source):
    settings = EngineSettings(max_adapters=2, max_adapter_rank=128)
    spec = await ops_for(source, "cpu", settings, GpuInventory([]))._spec(instance(3), source.path)
    args = " ".join(spec.argv)
    assert "--max-adapters 2" in args and "--max-lora-rank 128" in args
    plain = await ops_for(source, "cpu", EngineSettings(), GpuInventory([]))._spec(instance(4), source.path)
    assert "--max-lora-rank" not in plain.argv  # the engine's own default: 64
    assert "--task" not in plain.argv
    embed = await ops_for(source, "cpu", EngineSettings(task="embed"), GpuInventory([]))._spec(
        instance(5), source.path
    )
    assert "--task embed" in " ".join(embed.argv)


class _TlsBackend:
    """A backend whose engines serve TLS (`warm_pool.engine_tls`): its files go into every launch."""

    def __init__(self, mount: str = "/etc/tls") -> None:
        import ssl

        from warm_pool.engine_tls import EngineTls

        self.engine_tls = EngineTls(f"{mount}/tls.crt", f"{mount}/tls.key", ssl.create_default_context())


async def test_engines_are_launched_with_the_backends_tls_files(source):
    backend = _TlsBackend()
    cpu = InstanceSettings(
        "big", source, "cpu", 30.0, 8, 300.0, 10.0, "127.0.0.1", None, None, EngineSettings()
    )
    spec = await InstanceOps(cpu, backend=backend, engines=object())._spec(instance(1), source.path)
    assert " ".join(spec.args).endswith("--tls-cert /etc/tls/tls.crt --tls-key /etc/tls/tls.key")
    vllm = InstanceSettings(
        "big", source, "vllm", 30.0, 8, 300.0, 10.0, "127.0.0.1", None, GPU_BUILD, EngineSettings()
    )
    ops = InstanceOps(vllm, backend=backend, engines=object(), gpus=GpuInventory([0]))
    args = " ".join((await ops._spec(instance(2), source.path)).args)
    assert "--ssl-certfile /etc/tls/tls.crt --ssl-keyfile /etc/tls/tls.key" in args
    # Without TLS, nothing of it.
    plain = await InstanceOps(cpu, backend=None, engines=object())._spec(instance(3), source.path)
    assert "--tls-cert" not in plain.args


async def test_stokers_engine_keeps_kv_in_its_deployments_scope(source):
    """Prefix KV kept across sleep and stop (`stoker engine --kv-keep-scope`) is the deployment's own:
    another deployment's engines on the same snapshot never read it."""
    spec = await ops_for(source, "cpu", EngineSettings(), GpuInventory([]))._spec(instance(6), source.path)
    assert "--kv-keep-scope big" in " ".join(spec.argv)
