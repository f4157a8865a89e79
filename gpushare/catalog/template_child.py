"""A child process that renders chat templates for the daemon's supervisor (api/template_runner.py).

One JSON request a line on stdin, one JSON answer a line on stdout: ``{"text": ...}``,
``{"handles_tools": ...}`` or ``{"error": ...}``. Each render stops itself at the request's
``timeout_s`` (an interval timer whose signal interrupts the template between two Python steps)
and the process's memory is capped, so a template that loops or grows without end fails its own
request, even if nobody is left to kill this process. Torch-free: Jinja2 and chat_template only.
"""

from __future__ import annotations

import json
import resource
import signal
import sys

from gpushare.catalog import chat_template

MEMORY_BYTES = 2 << 30  # address space: Python and Jinja2 take ~100 MiB; a prompt text is a few MiB
MAX_COMPILED = 32


class RenderTimeout(BaseException):  # not an Exception: nothing in a template or Jinja2 may catch it
    pass


def _alarm(signum, frame):
    raise RenderTimeout


def answer(request: dict, compiled: dict) -> dict:
    source = request.get("source")
    template = compiled.get(source)
    if template is None:
        if len(compiled) >= MAX_COMPILED:
            compiled.clear()
        template = compiled[source] = chat_template.compile_template(source)
    bos, eos = request.get("bos_token"), request.get("eos_token")
    if request.get("probe_tools"):
        return {"handles_tools": chat_template.handles_tools(template, bos, eos)}
    return {"text": chat_template.render(template, request["messages"], bos, eos,
                                         request.get("add_generation_prompt", True), request.get("max_chars"),
                                         **request.get("extra", {}))}


def serve(lines, out) -> None:
    compiled: dict = {}
    for line in lines:
        request = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, max(0.01, float(request.get("timeout_s", 10))))
        try:
            reply = answer(request, compiled)
        except RenderTimeout:
            reply = {"error": "timeout"}
        except MemoryError:
            compiled.clear()
            reply = {"error": f"the chat template ran out of memory ({MEMORY_BYTES >> 20} MiB)"}
        except RecursionError:
            reply = {"error": "the chat template nests calls too deep"}
        except chat_template.TemplateError as e:
            reply = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - the template's own failure (a TypeError in it): the request's
            reply = {"error": f"chat template failed: {type(e).__name__}: {e}"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps(reply) + "\n")  # ASCII: whatever the locale of stdout
        out.flush()


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the daemon's terminal: the daemon decides
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
