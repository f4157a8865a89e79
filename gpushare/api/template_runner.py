"""Chat templates rendered in child processes, so that a template that runs long can be stopped.

A model's chat template is code from a model file. Jinja2's sandbox keeps it from reaching out,
not from looping for ever or growing a string without end, and a thread cannot be stopped. So the
supervisor renders in child processes (gpushare/catalog/template_child.py, torch-free), at most one
per work thread (api/work.py), each rendering one template at a time. A render ends:
- with its text, at most ``WorkBudget.max_template_chars`` characters;
- at the request's deadline (``limits.work_timeout``), stopped by the child itself, or else killed;
- as soon as the client has left: its child is killed, within ``POLL_S``.
A killed child is replaced by a new one on the next render (about 0.2 s to start).
"""

from __future__ import annotations

import json
import select
import sys
import threading
from collections import OrderedDict

from gpushare.api.child_pool import ChildPool, kill
from gpushare.api.work import WorkBudget, WorkStopped
from gpushare.catalog.chat_template import TemplateError

POLL_S = 0.05  # how often a waiting render looks whether its client has left
KILL_GRACE_S = 0.5  # past the deadline, how long the child has to stop itself before it is killed
_children = ChildPool([sys.executable, "-m", "gpushare.catalog.template_child"])

_lock = threading.Lock()
_handles_tools: OrderedDict = OrderedDict()  # template source -> whether it renders `tools`


def _ask(budget: WorkBudget, request: dict) -> dict:
    """One request to a child; its answer. WorkStopped when the budget ends first (the child is killed)."""
    proc = _children.take()
    line = json.dumps({**request, "timeout_s": max(0.01, budget.left_s())}).encode() + b"\n"
    try:
        proc.stdin.write(line)
        proc.stdin.flush()
        reply = b""
        while not reply.endswith(b"\n"):
            if budget.cancelled.is_set() or budget.left_s() < -KILL_GRACE_S:
                kill(proc)
                raise WorkStopped("the chat template")
            if select.select([proc.stdout], [], [], POLL_S)[0]:
                chunk = proc.stdout.read(1 << 20)
                if not chunk:
                    raise BrokenPipeError("the template child exited")
                reply += chunk
    except (BrokenPipeError, OSError):
        kill(proc)
        raise TemplateError("the chat template failed: its renderer process exited") from None
    _children.give_back(proc)
    answer = json.loads(reply)
    if answer.get("error") == "timeout":
        raise WorkStopped("the chat template")
    if "error" in answer:
        raise TemplateError(answer["error"])
    return answer


def render(budget: WorkBudget, source: str | None, messages: list[dict], bos_token: str | None,
           eos_token: str | None, **extra) -> str:
    """chat_template.render of ``source`` (None: the default template) in a child, within ``budget``."""
    return _ask(budget, {"source": source, "messages": messages, "bos_token": bos_token, "eos_token": eos_token,
                         "add_generation_prompt": True, "max_chars": budget.max_template_chars,
                         "extra": extra})["text"]


def handles_tools(budget: WorkBudget, source: str | None, bos_token: str | None, eos_token: str | None) -> bool:
    """chat_template.handles_tools in a child; remembered per template."""
    known = _handles_tools.get(source)
    if known is None:
        known = _ask(budget, {"source": source, "bos_token": bos_token, "eos_token": eos_token,
                              "probe_tools": True})["handles_tools"]
        with _lock:
            _handles_tools[source] = known
            while len(_handles_tools) > 64:
                _handles_tools.popitem(last=False)
    return known

