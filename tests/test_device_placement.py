"""Every tensor the engine, the models and the kernels make is made on a named device, read from the
source with ``ast`` (nothing is imported).

A torch factory call (``torch.tensor``, ``zeros``, ``empty``, ``arange``, ``Generator``, ...)
without ``device=`` lands on the CPU whatever device the step runs on: on a GPU that is a wrong
device error (a CPU generator for CUDA probabilities), a silent host-to-device copy every step,
or a tensor on GPU 0 for an engine on GPU 1. Each call either names its device, or carries
``# host: <why>`` on one of its lines saying why it belongs on the host (a mapping of shared memory,
a GGUF block decoded while loading, a C++ kernel's scratch). ``*_like`` and ``Tensor.new_*``
inherit their source's device and are not listed; ``from_numpy`` and ``frombuffer`` cannot take a
device and always need the marker.

A failure names the file, the line and the call.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "models", "kernels")
FACTORIES = {
    "tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "empty", "full", "empty_strided", "arange",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "normal", "Generator",
    "tril_indices", "triu_indices", "from_numpy", "frombuffer",
}
HOST_MARKER = re.compile(r"#\s*host:\s*\S")  # a reason must follow


def unplaced_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) for each torch factory call in ``source`` with no ``device=`` and no host marker."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" or k.arg is None for k in node.keywords):  # None: **kwargs may name it
            continue
        if any(HOST_MARKER.search(line) for line in lines[node.lineno - 1:node.end_lineno]):
            continue
        found.append((node.lineno, f"torch.{node.func.attr}"))
    return sorted(found)


def test_every_factory_call_names_its_device_or_says_why_host():
    problems = []
    for folder in FOLDERS:
        for path in sorted((ROOT / "gpushare" / folder).rglob("*.py")):
            for line, call in unplaced_calls(path.read_text()):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {call} without device= or '# host: <why>'")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_what_it_should():
    """The rule itself: calls over several lines, keyword devices, markers with and without a reason."""
    source = (
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device=x.device)\n"
        "c = torch.tensor([1, 2],\n"
        "                 dtype=torch.long)  # host: read back by the C++ kernel\n"
        "d = torch.Generator()  # host:\n"
        "e = torch.empty_like(a)\n"
        "f = torch.arange(4, **on_device)\n"
        "g = torch.frombuffer(buf, dtype=torch.uint8)\n"
    )
    assert unplaced_calls(source) == [(2, "torch.zeros"), (6, "torch.Generator"), (9, "torch.frombuffer")]
