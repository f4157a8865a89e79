"""engine.devices, models[].device, models[].replicas and the models[].tensor_parallel keys: parsed, and
refused with the key named."""

import pytest

from gpushare.settings.settings import ConfigError, parse_settings

GPU0 = "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1"  # of the 8xH100 capture
MIG = "MIG-1d5f8a42-6c0e-5b2a-9f31-0a7d4c2b8e61"
ACCEPTED = "expected 'cuda:N', a GPU UUID (GPU-...), a MIG UUID (MIG-...), 'cpu' or 'cpu:CPULIST' (e.g. cpu:0-3,8)"


def settings(engine=None, models=None, tmp_path=None):
    raw = {"engine": engine or {}}
    if models is not None:
        for model in models:
            (tmp_path / "m.gguf").write_bytes(b"GGUF")
            model.setdefault("path", str(tmp_path / "m.gguf"))
        raw["models"] = models
    return parse_settings(raw, env={})


def refused(message, **kwargs):
    with pytest.raises(ConfigError) as error:
        settings(**kwargs)
    assert str(error.value) == message


def test_devices_default_to_auto_and_keep_engine_device():
    s = settings({"device": "cpu"})
    assert (s.engine.devices, s.engine.device) == (None, "cpu")
    assert settings({"devices": "auto"}).engine.devices is None


def test_a_list_of_every_form_is_kept_as_written():
    devices = ["cuda:0", GPU0.replace("b42", "c42"), MIG, "MIG-GPU-4200ccc0-2667-d4cb-9137-f932c716232a/7/0",
               "cpu:0-3,8", "cpu"]
    assert settings({"devices": devices, "device": "cuda"}).engine.devices == devices


def test_bad_entries_name_their_index_and_what_is_accepted():
    refused(f"engine.devices[1]: 'gpu0' is not a device; {ACCEPTED}", engine={"devices": ["cuda:0", "gpu0"]})
    refused(f"engine.devices[0]: 7 is not a device; {ACCEPTED}", engine={"devices": [7]})
    refused(f"engine.devices[0]: 'cpu:4-' is not a device; {ACCEPTED}", engine={"devices": ["cpu:4-"]})
    refused("engine.devices: must be auto or a non-empty list of devices, got a list of 0 items", engine={"devices": []})
    refused("engine.devices: must be auto or a non-empty list of devices, got str 'cuda:0'", engine={"devices": "cuda:0"})


def test_duplicates_and_shared_cpus_are_refused():
    refused("engine.devices[2]: 'cuda:1' is listed twice", engine={"devices": ["cuda:1", "cpu", "cuda:1"]})
    refused("engine.devices[1]: CPU 3 is in cpu:0-3 too; two workers cannot own one CPU",
            engine={"devices": ["cpu:0-3", "cpu:3-5"]})


def test_model_device_and_replicas(tmp_path):
    s = settings({"devices": ["cuda:0", "cuda:1", "cpu"]},
                 [{"name": "a", "device": "cuda:1"}, {"name": "b", "replicas": 2}, {"name": "c"}], tmp_path)
    assert [(m.name, m.device, m.replicas) for m in s.models] == [("a", "cuda:1", 1), ("b", None, 2), ("c", None, 1)]
    auto = settings({}, [{"name": "a", "device": MIG, "replicas": 1}], tmp_path)
    assert (auto.models[0].device, auto.models[0].replicas) == (MIG, 1)


def test_model_device_must_be_one_of_the_listed_devices(tmp_path):
    refused("models[0].device: 'cuda:2' is not one of engine.devices (cuda:0, cpu)",
            engine={"devices": ["cuda:0", "cpu"]}, models=[{"name": "a", "device": "cuda:2"}], tmp_path=tmp_path)
    refused(f"models[0].device: 'cuda' is not a device; {ACCEPTED}",
            models=[{"name": "a", "device": "cuda"}], tmp_path=tmp_path)
    refused("models[0].device: 'cuda:0' cannot run with engine.device cpu",
            engine={"device": "cpu"}, models=[{"name": "a", "device": "cuda:0"}], tmp_path=tmp_path)
    refused("models[0].device: 'cpu' cannot run with engine.device cuda",
            engine={"device": "cuda"}, models=[{"name": "a", "device": "cpu"}], tmp_path=tmp_path)


def test_replicas_must_be_positive_and_fit_the_devices(tmp_path):
    refused("models[0].replicas: must be a positive integer, got 0", models=[{"name": "a", "replicas": 0}],
            tmp_path=tmp_path)
    refused("models[0].replicas: must be a positive integer, got True", models=[{"name": "a", "replicas": True}],
            tmp_path=tmp_path)
    refused("models[0].replicas: a model pinned to one device (models[0].device) runs once, got 2",
            models=[{"name": "a", "replicas": 2, "device": "cuda:0"}], tmp_path=tmp_path)
    refused("models[0].replicas: at most one per device, and engine.devices names 2, got 3",
            engine={"devices": ["cuda:0", "cuda:1"]}, models=[{"name": "a", "replicas": 3}], tmp_path=tmp_path)


def test_tensor_parallel_keys(tmp_path):
    two = {"devices": ["cuda:0", "cuda:1", "cpu:0", "cpu:1"]}
    s = settings(two, [{"name": "plain"}, {"name": "tp", "tensor_parallel": 2},
                       {"name": "auto", "tensor_parallel": "auto", "tensor_parallel_cross_numa": True},
                       {"name": "named", "tensor_parallel_devices": ["cpu:1", "cpu:0"]}], tmp_path)
    assert [(m.tensor_parallel, m.tensor_parallel_devices, m.tensor_parallel_cross_numa) for m in s.models] == [
        (1, None, False), (2, None, False), ("auto", None, True), (2, ["cpu:1", "cpu:0"], False)]
    auto_devices = settings({}, [{"name": "a", "tensor_parallel": 8}], tmp_path)  # engine.devices auto: planned later
    assert auto_devices.models[0].tensor_parallel == 8


def test_tensor_parallel_refusals_name_the_key(tmp_path):
    two = {"devices": ["cuda:0", "cuda:1"]}
    for value in (0, True, "two", 1.5):
        refused(f"models[0].tensor_parallel: must be a positive integer or auto, got {value!r}",
                models=[{"name": "a", "tensor_parallel": value}], tmp_path=tmp_path)
    refused("models[0].tensor_parallel: 4 needs 4 devices, and engine.devices names 2",
            engine=two, models=[{"name": "a", "tensor_parallel": 4}], tmp_path=tmp_path)
    for other, value in (("device", "cuda:0"), ("replicas", 2)):
        refused(f"models[0].{other}: a tensor-parallel model (tensor_parallel 2) is one group; use "
                "tensor_parallel_devices to name its devices",
                engine=two, models=[{"name": "a", "tensor_parallel": 2, other: value}], tmp_path=tmp_path)
    refused("models[0].device: a tensor-parallel model (tensor_parallel auto) is one group; use "
            "tensor_parallel_devices to name its devices",
            engine=two, models=[{"name": "a", "tensor_parallel": "auto", "device": "cuda:1"}], tmp_path=tmp_path)
    refused("models[0].tensor_parallel_cross_numa: must be true or false, got 'yes'",
            models=[{"name": "a", "tensor_parallel": 2, "tensor_parallel_cross_numa": "yes"}], tmp_path=tmp_path)


def test_tensor_parallel_devices_refusals(tmp_path):
    key = "models[0].tensor_parallel_devices"
    cases = [
        (["cuda:0"], f"{key}: must be a list of two or more engine.devices entries (one device is models[].device), "
                     "got ['cuda:0']"),
        ("cuda:0", f"{key}: must be a list of two or more engine.devices entries (one device is models[].device), "
                   "got 'cuda:0'"),
        (["cuda:0", "cuda:2"], f"{key}[1]: 'cuda:2' is not one of engine.devices (cuda:0, cuda:1, cpu)"),
        (["cuda:0", "cuda:0"], f"{key}[1]: 'cuda:0' is listed twice"),
        (["cuda:0", "gpu0"], f"{key}[1]: 'gpu0' is not a device; {ACCEPTED}"),
        (["cuda:0", "cpu"], f"{key}: a CPU and a GPU never form one group; name devices of one kind"),
    ]
    for devices, message in cases:
        refused(message, engine={"devices": ["cuda:0", "cuda:1", "cpu"]},
                models=[{"name": "a", "tensor_parallel_devices": devices}], tmp_path=tmp_path)
    refused(f"{key}: names 2 devices, and tensor_parallel is 3",
            models=[{"name": "a", "tensor_parallel": 3, "tensor_parallel_devices": ["cuda:0", "cuda:1"]}],
            tmp_path=tmp_path)
