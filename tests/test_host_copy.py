"""Warm-tier copies (models/host_copy.py): on CUDA pinned host memory and a stream of their own,
so moving a model does not wait for, nor hold up, serving's kernels on the default stream. The
CUDA stream API is faked (the hardware boundary); the tensors and the model are real."""

import contextlib

import torch

from gpushare.models.host_copy import CopyPlan, _copy, copy_plan, to_device, to_host


def test_a_gpu_move_pins_host_memory_and_copies_on_a_side_stream():
    plan = copy_plan("cuda:1")
    assert plan.device == "cuda:1" and plan.pin_memory and plan.side_stream
    assert copy_plan("cpu") is None and copy_plan("cpu:0-3") is None


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))


class _StreamApi:
    """torch.cuda's stream calls, recording which stream each copy is issued on."""

    def __init__(self):
        self.log, self.current = [], "default"

    def current_stream(self, device):
        return _Stream("default", self.log)

    def Stream(self, device):  # noqa: N802 (torch.cuda's name)
        self.log.append(("new stream", device))
        return _Stream("side", self.log)

    @contextlib.contextmanager
    def stream(self, s):
        self.current = s.name
        yield
        self.current = "default"


def test_a_move_copies_every_weight_on_the_side_stream_after_serving_s_queued_work_and_waits_for_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied, as an LLM's output matrix and embedding
    model.register_buffer("rope", torch.randn(3))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    api, issued = _StreamApi(), []
    real_copy = torch.Tensor.copy_

    def spy(self, source, non_blocking=False):
        issued.append((api.current, non_blocking, len(api.log)))
        return real_copy(self, source, non_blocking)

    torch.Tensor.copy_ = spy
    try:
        # pin_memory off: this machine's torch has no pinned allocator; the plan's flag is tested above
        _copy(model, CopyPlan("cuda:0", pin_memory=False, side_stream=True), "cpu", cuda=api)
    finally:
        torch.Tensor.copy_ = real_copy
    assert api.log[:2] == [("new stream", "cuda:0"), ("wait", "side", "default")]
    assert api.log[2:] == [("synchronize", "side")]
    # two tensors: the tied weight once, the buffer; each issued on the side stream after the wait
    assert issued == [("side", True, 2), ("side", True, 2)]
    assert model[1].weight is model[0].weight
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


def test_on_the_cpu_a_move_leaves_the_model_where_it_is():
    class Loaded:
        device = "cpu"
        model = torch.nn.Linear(2, 2)

    loaded = Loaded()
    weight = loaded.model.weight
    assert to_host(loaded) is loaded and to_device(loaded, "cpu") is loaded
    assert loaded.model.weight is weight
