"""Parsing nvidia-smi text as real drivers print it (captures in tests/fixtures/node/nvidia/)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
import make_nvidia_outputs  # noqa: E402
from node_fakes import recorded  # noqa: E402

from gpushare.node import nvsmi  # noqa: E402


def text(name):
    return recorded(name).stdout


def profiles(name):
    return [(p.gpu, p.name, p.profile_id, p.free, p.total, p.memory_gib, p.slices)
            for p in nvsmi.parse_gi_profiles(text(name))]


def test_gpu_instance_profiles_gh200_and_h200():
    assert profiles("gh200-96gb_nvidia-smi-mig-lgip.txt") == [
        (0, "1g.12gb", 19, 7, 7, 11.0, 1), (0, "1g.12gb+me", 20, 1, 1, 11.0, 1), (0, "1g.24gb", 15, 4, 4, 23.0, 1),
        (0, "2g.24gb", 14, 3, 3, 23.0, 2), (0, "3g.48gb", 9, 2, 2, 46.5, 3), (0, "4g.48gb", 5, 1, 1, 46.5, 4),
        (0, "7g.96gb", 0, 1, 1, 93.0, 7)]
    # Verbatim fragments of an 8-GPU H200 box: rows of GPUs 2 and 3, a wide 7g.141gb name, a cut-off last row.
    assert profiles("h200-141gb_nvidia-smi-mig-lgip_fragment-gpu2-gpu3.txt") == [
        (2, "3g.71gb", 9, 2, 2, 69.5, 3), (2, "4g.71gb", 5, 1, 1, 69.5, 4), (2, "7g.141gb", 0, 1, 1, 139.75, 7),
        (3, "1g.18gb", 19, 7, 7, 16.0, 1), (3, "1g.18gb+me", 20, 1, 1, 16.0, 1), (3, "1g.35gb", 15, 4, 4, 32.25, 1)]
    assert [p[1] for p in profiles("h200-141gb_nvidia-smi-mig-lgip_fragment-gpu6.txt")] == [
        "1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb"]


def test_gpu_and_compute_instances():
    instances = nvsmi.parse_gpu_instances(text("a100-40gb_nvidia-smi-mig-lgi_2x3g.20gb.txt"))
    assert [(gi.profile, gi.profile_id, gi.instance_id, gi.placement) for gi in instances] == [
        ("3g.20gb", 9, 1, (4, 4)), ("3g.20gb", 9, 2, (0, 4))]
    older = nvsmi.parse_compute_instances(text("a100-40gb_nvidia-smi-mig-lci-gi1_3x1c.txt"))  # no Placement column
    assert [(ci.gpu_instance_id, ci.profile, ci.profile_id, ci.instance_id) for ci in older] == [
        (1, "1c.3g.20gb", 0, 0), (1, "1c.3g.20gb", 0, 1), (1, "1c.3g.20gb", 0, 2)]
    # The newer -lci layout adds a Start:Size column (a row as recent drivers print it).
    newer = nvsmi.parse_compute_instances("|   0      7       MIG 1g.10gb          0         0          0:1     |\n")
    assert [(ci.gpu_instance_id, ci.profile, ci.instance_id) for ci in newer] == [(7, "1g.10gb", 0)]
    assert nvsmi.nothing_listed(text("nvidia-smi-mig-lgi_none.txt"))
    assert nvsmi.nothing_listed("No MIG-enabled devices found.\n")


def test_list_gpus_modern_and_legacy_mig_uuids():
    [h100] = nvsmi.parse_list(text("h100-80gb_nvidia-smi-L_mig-mixed.txt"))
    assert (h100.index, h100.name) == (0, "NVIDIA H100 80GB HBM3")
    assert h100.uuid == "GPU-b4895dbf-9350-2524-a89b-98161ddd9fe4"
    assert [(m.profile, m.device_index, m.uuid) for m in h100.mig_devices] == [
        ("3g.40gb", 0, "MIG-7089d0f3-293f-58c9-8f8c-5ea666eedbde"),
        ("2g.20gb", 1, "MIG-56c30729-347f-5dd6-8da0-c3cc59e969e0"),
        ("1g.10gb", 2, "MIG-9d14fb21-4ae1-546f-a636-011582899c39"),
        ("1g.10gb", 3, "MIG-0f709664-740c-52b0-ae79-3e4c9ede6d3b")]
    [a100] = nvsmi.parse_list(text("a100-40gb_nvidia-smi-L_mig-mixed_r450-uuid.txt"))
    assert a100.name == "A100-SXM4-40GB"
    assert a100.mig_devices[0].uuid == "MIG-GPU-4200ccc0-2667-d4cb-9137-f932c716232a/2/0"
    assert [g.uuid for g in nvsmi.parse_list(text("2xa10_nvidia-smi-L_no-mig.txt"))] == [
        "GPU-ebd34bdf-1083-eaac-2aff-4b71a022f9bd", "GPU-1795e88b-3395-b27b-dad8-0488474eec0c"]


def test_query_rows():
    [row] = nvsmi.parse_query(text("h200_query-gpu_mig-pending-enable.csv.txt"))
    assert (row.index, row.name, row.pci_bus_id, row.mig_current, row.mig_pending, row.compute_mode) == (
        0, "NVIDIA H200", "00000000:1B:00.0", "Disabled", "Enabled", "Default")
    assert row.mig_supported
    assert not nvsmi.parse_query("0, GPU-x, NVIDIA A10, 00000000:17:00.0, [N/A], [N/A], Default\n")[0].mig_supported


def test_tool_messages():
    partial = text("a100-40gb_nvidia-smi-mig-cgi-19-19-14-9_insufficient-resources.txt")
    assert nvsmi.failure_reason(partial) == "Insufficient Resources"
    assert nvsmi.created_gpu_instances(partial) == [13, 11, 3] and nvsmi.created_compute_instances(partial) == 0
    ok = text("gh200-96gb_nvidia-smi-mig-cgi-15x3-C_ok.txt")
    assert nvsmi.failure_reason(ok) is None
    assert nvsmi.created_gpu_instances(ok) == [5, 3, 4] and nvsmi.created_compute_instances(ok) == 3
    in_use = text("gh200-96gb_nvidia-smi-mig-cgi_in-use-by-another-client.txt")
    assert nvsmi.failure_reason(in_use) == "In use by another client"
    assert nvsmi.pending_mode_change(text("a100_nvidia-smi-mig-enable_in-use-by-another-client.txt")) == (
        "MIG mode is pending enable on 00000000:07:00.0: In use by another client")
    assert nvsmi.pending_mode_change(text("a100_nvidia-smi-mig-enable_pending-not-supported.txt")) == (
        "MIG mode is pending enable on 00000000:00:03.0: Not Supported")
    assert nvsmi.pending_mode_change(text("a100-40gb_nvidia-smi-mig-enable_ok.txt")) is None


def test_constructed_outputs_are_what_their_generator_writes():
    # Its table formatters first reproduce real captures byte for byte (asserted inside).
    assert make_nvidia_outputs.main(["--check"]) == 0
