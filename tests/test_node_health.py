"""GPU health through NVML: faults injected into the fake built from the 8xH100 `nvidia-smi -q`,
whose own values (no ECC error, no remap, no page retirement on Hopper) read as healthy."""

import sys
from pathlib import Path

import pynvml

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import FakeNvml, a100_7x1g, h100_node_gpus, h100_with_mig  # noqa: E402

from gpushare.node.gpu_health import NO_GPU_INSTANCE, DeviceHealth, XidEvent, XidWatch, read_health  # noqa: E402


def node():
    gpus = h100_node_gpus()
    return gpus, FakeNvml(gpus)


def test_the_captured_h100_is_healthy_and_says_what_it_cannot_check():
    gpus, nvml = node()
    assert read_health(nvml, gpus[0].uuid) == DeviceHealth(True, [], ["retired pages: Not Supported"])
    assert not nvml.initialised  # shut down again


def test_volatile_uncorrected_ecc_errors_make_it_unhealthy():
    gpus, nvml = node()
    gpus[3].volatile_uncorrected_ecc = 2
    health = read_health(nvml, gpus[3].uuid)
    assert not health.healthy
    assert health.reasons == [f"2 uncorrected ECC error(s) on {gpus[3].uuid} since the driver loaded"]
    assert read_health(nvml, gpus[2].uuid).healthy


def test_pending_page_retirement_and_failed_row_remap():
    gpus, nvml = node()
    gpus[0].retired_pages_pending = pynvml.NVML_FEATURE_ENABLED  # as a GPU that retires pages reports it
    assert read_health(nvml, gpus[0].uuid).reasons == [
        f"retired pages are pending on {gpus[0].uuid}: the GPU needs a reset"]
    gpus[0].retired_pages_pending = pynvml.NVML_FEATURE_DISABLED
    assert read_health(nvml, gpus[0].uuid) == DeviceHealth(True, [], [])
    gpus[1].remapped_rows = (0, 1, 1, 0)  # a remap waiting for a reset is not a failure
    assert read_health(nvml, gpus[1].uuid).healthy
    gpus[1].remapped_rows = (0, 1, 0, 1)
    assert read_health(nvml, gpus[1].uuid).reasons == [f"row remapping failed on {gpus[1].uuid}: the GPU needs service"]


def test_unsupported_checks_are_unknown_not_unhealthy():
    gpus, nvml = node()
    gpus[0].volatile_uncorrected_ecc = gpus[0].remapped_rows = None  # a card without ECC or row remapping
    assert read_health(nvml, gpus[0].uuid) == DeviceHealth(True, [], [
        "ECC errors: Not Supported", "retired pages: Not Supported", "remapped rows: Not Supported"])


def test_a_mig_instance_is_judged_by_its_gpu():
    mig = h100_with_mig()
    nvml = FakeNvml([mig])
    assert read_health(nvml, mig.migs[0].uuid).healthy
    mig.volatile_uncorrected_ecc = 1
    assert read_health(nvml, mig.migs[1].uuid).reasons == [
        f"1 uncorrected ECC error(s) on {mig.uuid} since the driver loaded"]
    legacy = a100_7x1g()  # MIG-GPU-<uuid>/<gi>/<ci> ids name their GPU
    legacy.remapped_rows = (0, 0, 0, 1)
    assert read_health(FakeNvml([legacy]), legacy.migs[6].uuid).reasons == [
        f"row remapping failed on {legacy.uuid}: the GPU needs service"]


def test_a_lost_or_vanished_gpu_is_unhealthy():
    gpus, nvml = node()
    gpus[5].lost = True
    assert read_health(nvml, gpus[5].uuid) == DeviceHealth(False, [f"{gpus[5].uuid}: GPU is lost"], [])
    gone = "GPU-00000000-0000-0000-0000-000000000000"
    assert read_health(nvml, gone) == DeviceHealth(False, [f"{gone}: Not Found"])


def test_no_nvml_or_a_broken_one_never_raises():
    gpus = h100_node_gpus()
    no_driver = FakeNvml(gpus, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert read_health(no_driver, gpus[0].uuid) == DeviceHealth(True, [], ["NVML is not available (Driver Not Loaded)"])

    class Broken(FakeNvml):
        def nvmlDeviceGetRemappedRows(self, handle):
            raise RuntimeError("ctypes went wrong")

    assert read_health(Broken(gpus), gpus[0].uuid) == DeviceHealth(
        True, [], ["the health check failed: RuntimeError: ctypes went wrong"])


def test_xid_watch_reports_critical_xids_without_blocking():
    gpus, nvml = node()
    watch = XidWatch([gpu.uuid for gpu in gpus[:2]], nvml)
    assert set(nvml.registered) == {gpus[0].uuid, gpus[1].uuid}
    assert watch.poll() == []
    nvml.xid_queue += [(gpus[0], 13, NO_GPU_INSTANCE),  # a program's fault: the GPU is fine
                       (gpus[0], 79, NO_GPU_INSTANCE),  # fallen off the bus
                       (gpus[4], 48, NO_GPU_INSTANCE)]  # not watched
    assert watch.poll() == [XidEvent(gpus[0].uuid, 79, None)]
    assert set(nvml.wait_timeouts_ms) == {0}
    assert read_health(nvml, gpus[0].uuid, watch).reasons == [f"Xid 79 on {gpus[0].uuid}"]
    assert read_health(nvml, gpus[1].uuid, watch).healthy
    watch.close()


def test_xids_of_one_mig_instance_leave_its_siblings_healthy():
    mig = h100_with_mig()  # GPU instances 1 and 2
    nvml = FakeNvml([mig])
    watch = XidWatch([mig.uuid], nvml)
    nvml.xid_queue.append((mig, 94, 2))  # contained ECC error in GPU instance 2
    watch.poll()
    assert read_health(nvml, mig.migs[0].uuid, watch).healthy
    assert read_health(nvml, mig.migs[1].uuid, watch).reasons == [f"Xid 94 on {mig.uuid}"]
    nvml.xid_queue.append((mig, 79, NO_GPU_INSTANCE))
    watch.poll()
    assert read_health(nvml, mig.migs[0].uuid, watch).reasons == [f"Xid 79 on {mig.uuid}"]


def test_xid_watch_without_event_support_says_so_and_polls_nothing():
    gpus, nvml = node()
    nvml.events_unsupported = True
    watch = XidWatch([gpus[0].uuid], nvml)
    assert watch.unchecked == [f"Xid events of {gpus[0].uuid}: Not Supported"]
    assert watch.poll() == []
    no_driver = XidWatch([gpus[0].uuid], FakeNvml(gpus, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert no_driver.unchecked == ["Xid events: Driver Not Loaded"] and no_driver.poll() == []


def test_this_machine_through_the_real_pynvml():
    uuid = "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1"  # not this machine's: NVML, if any, does not find it
    health = read_health(None, uuid)
    watch = XidWatch([uuid])
    assert watch.poll() == []
    watch.close()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no driver here: nothing known, nothing raised
        assert health == DeviceHealth(True, [], [f"NVML is not available ({exc})"])
        assert watch.unchecked == [f"Xid events: {exc}"]
        return
    pynvml.nvmlShutdown()
    assert health == DeviceHealth(False, [f"{uuid}: Not Found"])
