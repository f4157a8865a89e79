"""The node: section of the config: defaults, accepted forms, errors that name the key."""

import pytest
import yaml

from gpushare.node.node_settings import MpsSettings, NodeSettings, parse_node_settings


def test_defaults_manage_nothing():
    assert parse_node_settings(None) == NodeSettings(manage=False, cpus=None, mig={}, mps=MpsSettings())
    assert parse_node_settings({}) == NodeSettings()
    assert MpsSettings().root == "/run/gpushare/mps"


def test_a_full_section_from_yaml():
    raw = yaml.safe_load("""
node:
  manage: true
  cpus: "0-7,16-23"
  mig:
    all: ["3g.71gb", "3g.71gb"]
    "1": ["MIG 1g.18gb", "1g.18gb+me"]
    GPU-5d3c06a2-3b8e-4c1e-9f2a-7e41b08c9d10: []
  mps:
    enabled: true
    active_thread_percentage: 50
    pinned_device_mem_limit: 40G
""")["node"]
    settings = parse_node_settings(raw)
    assert settings.manage is True
    assert settings.cpus == list(range(8)) + list(range(16, 24))
    assert settings.mig == {"all": ["3g.71gb", "3g.71gb"], "1": ["1g.18gb", "1g.18gb+me"],
                            "GPU-5d3c06a2-3b8e-4c1e-9f2a-7e41b08c9d10": []}
    assert settings.mps == MpsSettings(True, 50, "40G", "/run/gpushare/mps")
    assert parse_node_settings({"cpus": [3, 1, 1]}).cpus == [1, 3]


@pytest.mark.parametrize("raw, message", [
    ({"cpu": [0]}, "node: unknown key 'cpu'"),
    ({"manage": "yes"}, "node.manage: expected true or false"),
    ({"cpus": "0-x"}, "node.cpus: '0-x' is not a CPU list"),
    ({"cpus": [0, "1"]}, "node.cpus: expected a list of CPU numbers"),
    ({"cpus": []}, "node.cpus: expected at least one CPU"),
    ({"mig": ["3g.71gb"]}, "node.mig: expected a mapping"),
    ({"mig": {"gpu0": ["3g.71gb"]}}, "node.mig.gpu0: the key must be a GPU uuid"),
    ({"mig": {"all": "3g.71gb"}}, "node.mig.all: expected a list of profile names"),
    ({"mig": {"0": ["3g"]}}, "node.mig.0: '3g' is not a GPU instance profile name"),
    ({"mps": {"active_thread_percentage": 0}}, "node.mps.active_thread_percentage: expected a whole number 1..100"),
    ({"mps": {"active_thread_percentage": 50.5}}, "node.mps.active_thread_percentage"),
    ({"mps": {"pinned_device_mem_limit": "40GB"}},
     "node.mps.pinned_device_mem_limit: expected a whole number followed by G or M"),
    ({"mps": {"root": "/tmp/nvidia-mps"}}, "node.mps.root: must not be under /tmp"),
    ({"mps": {"root": "run/mps"}}, "node.mps.root: expected an absolute path"),
    ({"mps": {"enabled": 1}}, "node.mps.enabled: expected true or false"),
    ({"mps": {"percent": 5}}, "node.mps: unknown key 'percent'"),
])
def test_errors_name_the_key(raw, message):
    with pytest.raises(ValueError) as error:
        parse_node_settings(raw)
    assert str(error.value).startswith(message)
