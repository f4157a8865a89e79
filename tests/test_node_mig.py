"""MIG layouts applied through a runner that replays recorded nvidia-smi outputs: exact command
sequences, idempotence, and the failures real GPUs answer with."""

import sys
from itertools import permutations
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import Recorded, ReplayRunner, recorded  # noqa: E402

from gpushare.node import mig  # noqa: E402
from gpushare.node.nvsmi import parse_query  # noqa: E402

QUERY = ("nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,mig.mode.current,mig.mode.pending,compute_mode "
         "--format=csv,noheader")
LGIP, LGI, LCI = "nvidia-smi mig -i 0 -lgip", "nvidia-smi mig -i 0 -lgi", "nvidia-smi mig -i 0 -lci"
DCI, DGI = "nvidia-smi mig -i 0 -dci", "nvidia-smi mig -i 0 -dgi"
NONE_GI, NONE_CI = recorded("nvidia-smi-mig-lgi_none.txt"), recorded("nvidia-smi-mig-lci_none.txt")
READS = [QUERY, LGIP, LGI, LCI]


def cgi(ids):
    return f"nvidia-smi mig -i 0 -cgi {ids} -C"


def h200_runner():
    """An H200 with MIG off, which turns into 2x 3g.71gb."""
    return ReplayRunner({
        QUERY: [recorded("h200_query-gpu_mig-disabled.csv.txt"), recorded("h200_query-gpu_mig-enabled.csv.txt")],
        "nvidia-smi -i 0 -mig 1": recorded("h200-141gb_nvidia-smi-mig-enable_ok.txt"),
        LGIP: recorded("h200-141gb_nvidia-smi-mig-lgip_composed-gpu0.txt"),
        LGI: [NONE_GI, recorded("h200-141gb_nvidia-smi-mig-lgi_2x3g.71gb.txt")],
        LCI: [NONE_CI, recorded("h200-141gb_nvidia-smi-mig-lci_2x3g.71gb.txt")],
        cgi("9,9"): recorded("h200-141gb_nvidia-smi-mig-cgi-9-9-C_ok.txt"),
    })


def test_h200_from_mig_off_to_two_3g71gb_then_nothing_to_do():
    layout = {"all": ["3g.71gb", "3g.71gb"]}  # the example
    planning = h200_runner()
    [plan] = mig.plan_mig(planning, layout)
    assert [c.shell() for c in plan.commands] == ["nvidia-smi -i 0 -mig 1",
                                                  "nvidia-smi mig -i 0 -cgi 3g.71gb,3g.71gb -C"]
    assert planning.calls == [QUERY]  # planning only reads
    runner = h200_runner()
    [result] = mig.apply_mig(runner, layout)
    assert (result.changed, result.error, result.summary) == (True, None, "enable MIG, then create 2× 3g.71gb")
    assert runner.calls == [QUERY, "nvidia-smi -i 0 -mig 1", LGIP, LGI, LCI, cgi("9,9"), LGI, LCI]
    runner.calls.clear()
    [again] = mig.apply_mig(runner, layout)
    assert (again.changed, again.summary) == (False, "2× 3g.71gb, as configured")
    assert runner.calls == READS  # the second apply changes nothing


def h100_runner():
    """An H100 with 7x 1g.10gb, which turns into 2x 3g.40gb."""
    return ReplayRunner({
        QUERY: recorded("h100_query-gpu_mig-enabled.csv.txt"),
        LGIP: recorded("h100-80gb_nvidia-smi-mig-lgip.txt"),
        LGI: [recorded("h100-80gb_nvidia-smi-mig-lgi_7x1g.10gb.txt"),
              recorded("h100-80gb_nvidia-smi-mig-lgi_2x3g.40gb.txt")],
        LCI: [recorded("h100-80gb_nvidia-smi-mig-lci_7x1g.10gb.txt"),
              recorded("h100-80gb_nvidia-smi-mig-lci_2x3g.40gb.txt")],
        DCI: recorded("h100-80gb_nvidia-smi-mig-dci_7x1g.10gb.txt"),
        DGI: recorded("h100-80gb_nvidia-smi-mig-dgi_7x1g.10gb.txt"),
        cgi("9,9"): recorded("h100-80gb_nvidia-smi-mig-cgi-9-9-C_ok.txt"),  # the MIG guide's H100 output
    })


def test_h100_relayout_destroys_compute_then_gpu_instances_then_creates():
    [plan] = mig.plan_mig(h100_runner(), {"0": ["3g.40gb", "3g.40gb"]})
    assert plan.summary == "7× 1g.10gb -> 2× 3g.40gb"
    assert [c.shell() for c in plan.commands] == [DCI, DGI, cgi("9,9")]
    runner = h100_runner()
    layout = {"0": ["3g.40gb", "3g.40gb"]}
    [result] = mig.apply_mig(runner, layout)
    assert result.changed and result.error is None
    assert runner.calls == READS + [DCI, DGI, cgi("9,9"), LGI, LCI]
    runner.calls.clear()
    assert not mig.apply_mig(runner, layout)[0].changed
    assert runner.calls == READS


def test_insufficient_resources_clears_and_tries_the_next_order():
    # The MIG guide's A100: -cgi 19,19,14,9 creates three GPU instances, then fails on the 3g.20gb.
    runner = ReplayRunner({
        QUERY: recorded("a100_query-gpu_mig-enabled.csv.txt"),
        LGIP: recorded("a100-40gb_nvidia-smi-mig-lgip.txt"),
        LGI: [NONE_GI, recorded("a100-40gb_nvidia-smi-mig-lgi_3-2-1-1.txt")],
        LCI: [NONE_CI, recorded("a100-40gb_nvidia-smi-mig-lci_3-2-1-1.txt")],
        cgi("19,19,14,9"): recorded("a100-40gb_nvidia-smi-mig-cgi-19-19-14-9_insufficient-resources.txt"),
        DGI: recorded("a100-40gb_nvidia-smi-mig-dgi_after-partial-cgi.txt"),
        cgi("9,14,19,19"): recorded("a100-40gb_nvidia-smi-mig-cgi-9-14-19-19-C_ok.txt"),
    })
    [result] = mig.apply_mig(runner, {"all": ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]})
    assert result.changed and result.error is None
    assert runner.calls == READS + [cgi("19,19,14,9"), DGI, cgi("9,14,19,19"), LGI, LCI]


def test_no_order_fits_is_a_clear_error_after_every_distinct_order():
    partial = recorded("a100-40gb_nvidia-smi-mig-cgi-19-19-14-9_insufficient-resources.txt")
    orders = {",".join(order) for order in permutations(["19", "19", "14", "9"])}
    runner = ReplayRunner({QUERY: recorded("a100_query-gpu_mig-enabled.csv.txt"),
                           LGIP: recorded("a100-40gb_nvidia-smi-mig-lgip.txt"), LGI: NONE_GI, LCI: NONE_CI,
                           DGI: recorded("a100-40gb_nvidia-smi-mig-dgi_after-partial-cgi.txt")}
                          | {cgi(order): partial for order in orders})
    [result] = mig.apply_mig(runner, {"all": ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]})
    assert not result.changed
    assert result.error.startswith("GPU 0: no creation order fits 2× 1g.5gb + 1× 2g.10gb + 1× 3g.20gb "
                                   "(Insufficient Resources for 12 order(s): 1g.5gb,1g.5gb,2g.10gb,3g.20gb; "
                                   "3g.20gb,2g.10gb,1g.5gb,1g.5gb; ")
    tried = [call for call in runner.calls if "-cgi" in call]
    assert len(tried) == len(set(tried)) == 12
    assert runner.calls.count(DGI) == 12  # every failed attempt is cleared before the next


def test_in_use_by_another_client_stops_without_retrying():
    runner = ReplayRunner({QUERY: recorded("gh200_query-gpu_mig-enabled.csv.txt"),
                           LGIP: recorded("gh200-96gb_nvidia-smi-mig-lgip.txt"), LGI: NONE_GI, LCI: NONE_CI,
                           cgi("15,15,15"): recorded("gh200-96gb_nvidia-smi-mig-cgi_in-use-by-another-client.txt")})
    [result] = mig.apply_mig(runner, {"0": ["1g.24gb"] * 3})
    assert result.error == (
        "GPU 0 (00000009:01:00.0): creating GPU instances failed: In use by another client. A process holds the GPU "
        "(nvidia-smi lists them; an MPS daemon counts too: gpushare node mps stop); stop it and apply again")
    assert runner.calls == READS + [cgi("15,15,15")]


@pytest.mark.parametrize("layout, error", [
    (["1g.12gb+me"] * 3,
     "GPU 0 (NVIDIA GH200 480GB, 00000009:01:00.0) allows at most 1× 1g.12gb+me; node.mig asks for 3"),
    (["3g.71gb"], "GPU 0 (NVIDIA GH200 480GB, 00000009:01:00.0) has no GPU instance profile '3g.71gb'; it offers: "
                  "1g.12gb, 1g.12gb+me, 1g.24gb, 2g.24gb, 3g.48gb, 4g.48gb, 7g.96gb"),
    (["4g.48gb", "3g.48gb", "1g.12gb"], "GPU 0 (NVIDIA GH200 480GB, 00000009:01:00.0): 1× 1g.12gb + 1× 3g.48gb + "
                                        "1× 4g.48gb needs 8 compute slices; the GPU has 7"),
])
def test_impossible_layouts_are_refused_before_any_change(layout, error):
    runner = ReplayRunner({QUERY: recorded("gh200_query-gpu_mig-enabled.csv.txt"),
                           LGIP: recorded("gh200-96gb_nvidia-smi-mig-lgip.txt"), LGI: NONE_GI, LCI: NONE_CI})
    [result] = mig.apply_mig(runner, {"all": layout})
    assert result.error == error
    assert runner.calls == READS


def test_pending_mode_change_in_the_query_is_reported_not_forced():
    runner = ReplayRunner({QUERY: recorded("h200_query-gpu_mig-pending-enable.csv.txt")})
    [result] = mig.apply_mig(runner, {"all": ["3g.71gb", "3g.71gb"]})
    assert result.error.startswith("GPU 0 (NVIDIA H200, 00000000:1B:00.0): MIG mode change pending "
                                   "(current Disabled, pending Enabled)")
    assert "gpushare never resets a GPU" in result.error
    assert runner.calls == [QUERY]


@pytest.mark.parametrize("answer, reason", [
    ("a100_nvidia-smi-mig-enable_in-use-by-another-client.txt", "In use by another client"),
    ("a100_nvidia-smi-mig-enable_pending-not-supported.txt", "Not Supported"),
])
def test_enable_that_stays_pending_is_reported_and_no_reset_is_issued(answer, reason):
    # nvidia-smi prints "All done." even here; the warning line is what tells.
    runner = ReplayRunner({QUERY: recorded("a100_query-gpu_mig-disabled.csv.txt"),
                           "nvidia-smi -i 0 -mig 1": recorded(answer)})
    [result] = mig.apply_mig(runner, {"all": ["3g.20gb", "3g.20gb"]})
    assert result.error.startswith("GPU 0 (00000000:36:00.0): MIG mode is pending enable on ")
    assert result.error.endswith(f"{reason}. The change takes effect after a GPU reset or a reboot; gpushare never "
                                 "resets a GPU. Stop what uses the GPU and reset it, or reboot, then apply again")
    assert runner.calls == [QUERY, "nvidia-smi -i 0 -mig 1"]  # no --gpu-reset, no -r


def test_empty_layout_turns_mig_off():
    runner = ReplayRunner({
        QUERY: recorded("h100_query-gpu_mig-enabled.csv.txt"), LGIP: recorded("h100-80gb_nvidia-smi-mig-lgip.txt"),
        LGI: recorded("h100-80gb_nvidia-smi-mig-lgi_2x3g.40gb.txt"),
        LCI: recorded("h100-80gb_nvidia-smi-mig-lci_2x3g.40gb.txt"),
        DCI: recorded("h100-80gb_nvidia-smi-mig-dci_2x3g.40gb.txt"),
        DGI: recorded("h100-80gb_nvidia-smi-mig-dgi_2x3g.40gb.txt"),
        "nvidia-smi -i 0 -mig 0": recorded("h100-80gb_nvidia-smi-mig-disable_ok.txt"),
    })
    [result] = mig.apply_mig(runner, {"GPU-b4895dbf-9350-2524-a89b-98161ddd9fe4": []})
    assert (result.changed, result.error, result.summary) == (True, None, "2× 3g.40gb -> MIG off")
    assert runner.calls == READS + [DCI, DGI, "nvidia-smi -i 0 -mig 0"]


def test_a_missing_compute_instance_is_created_alone():
    full = recorded("h200-141gb_nvidia-smi-mig-lci_2x3g.71gb.txt")
    gi2_row = next(line for line in full.stdout.splitlines(keepends=True) if line.startswith("|   0      2"))
    runner = ReplayRunner({
        QUERY: recorded("h200_query-gpu_mig-enabled.csv.txt"),
        LGIP: recorded("h200-141gb_nvidia-smi-mig-lgip_composed-gpu0.txt"),
        LGI: recorded("h200-141gb_nvidia-smi-mig-lgi_2x3g.71gb.txt"),
        LCI: [Recorded(full.stdout.replace(gi2_row, "")), full],
        # the -cci message format of the MIG guide's a100-40gb_nvidia-smi-mig-cci-0-0-0-gi1_ok.txt
        "nvidia-smi mig -i 0 -gi 2 -cci": Recorded(
            "Successfully created compute instance on GPU  0 GPU instance ID  2 using profile MIG 3g.71gb (ID  2)\n"),
    })
    [result] = mig.apply_mig(runner, {"all": ["3g.71gb", "3g.71gb"]})
    assert result.changed and result.error is None
    assert runner.calls == READS + ["nvidia-smi mig -i 0 -gi 2 -cci", LGI, LCI]


def test_gpu_selection_uuid_over_index_over_all():
    rows = parse_query(recorded("h100_query-gpu_mig-enabled.csv.txt").stdout + "1, GPU-x, NVIDIA H100 80GB HBM3, "
                       "00000000:43:00.0, Enabled, Enabled, Default\n")
    layouts = {"all": ["7g.80gb"], "1": ["3g.40gb"], "GPU-b4895dbf-9350-2524-a89b-98161ddd9fe4": []}
    assert [(row.index, desired) for row, desired in mig.desired_layouts(rows, layouts)] == [(0, []), (1, ["3g.40gb"])]
    with pytest.raises(mig.MigError, match=r"node.mig: no GPU matches '3' \(GPUs here: 0 GPU-b4895dbf"):
        mig.desired_layouts(rows, {"3": ["3g.40gb"]})
