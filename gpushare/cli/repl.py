"""The slash commands of `gpushare run`'s interactive chat (/set, /unset, /show, /load, /save, /clear, /bye).

Each acts on the session (gpushare/cli_run.Session) or asks the daemon, prints what it did, and
is never sent to the model; an unknown command says so.
"""

from __future__ import annotations

import sys

import json

from gpushare.cli.format import print_model_info
from gpushare.cli.http_client import ApiFailure, call, load_with_progress
from gpushare.settings.model_options import OptionError, option_from_text, parameters_text

SHOW_WHAT = ("info", "modelfile", "parameters", "system", "template", "license")
HELP = """Available commands:
  /set parameter NAME VALUE   set a model option for this session (e.g. temperature 0)
  /set system TEXT            set the system message
  /set format json            answer in JSON (/unset format to stop)
  /set verbose | quiet        print timings after each answer, or not
  /set history | nohistory    keep the lines typed in the history file, or not
  /unset parameter NAME | system | format
  /show info | modelfile | parameters | system | template | license
  /load MODEL                 switch to another model (the conversation starts afresh)
  /save MODEL                 save this session's options, system message and conversation as a new model
  /clear                      forget the conversation
  /bye                        exit
Start and end a message with \"\"\" to write several lines."""


def run_command(session, history, line: str) -> str | None:
    """Run one `/...` line; "bye" when the chat should end."""
    command, _, rest = line.partition(" ")
    words = rest.split()
    try:
        if command in ("/bye", "/exit"):
            return "bye"
        if command in ("/?", "/help"):
            print(HELP)
        elif command == "/clear":
            session.messages.clear()
            print("Cleared session context")
        elif command == "/set":
            _set(session, history, words, rest)
        elif command == "/unset":
            _unset(session, words)
        elif command == "/show":
            _show(session, words)
        elif command == "/load":
            if len(words) != 1:
                print("Usage: /load MODEL")
                return None
            print(f"Loading model '{words[0]}'")
            load_with_progress(words[0], session.keep_alive)
            session.model = words[0]
            session.messages.clear()
        elif command == "/save":
            if len(words) != 1:
                print("Usage: /save MODEL")
                return None
            body = {"model": words[0], "from": session.model, "parameters": session.options,
                    "messages": session.messages, "stream": False}
            if session.system is not None:
                body["system"] = session.system
            call("POST", "/api/create", body)
            print(f"Created new model '{words[0]}'")
        else:
            print(f"Unknown command '{command}'. Type /? for help")
    except ApiFailure as e:
        print(f"Error: {e}", file=sys.stderr)
    return None


def _set(session, history, words: list[str], rest: str) -> None:
    what = words[0] if words else ""
    if what == "parameter":
        print(set_parameter(session, words[1:]))
    elif what == "system":
        session.system = rest.strip()[len("system"):].strip()
        print("Set system message.")
    elif what == "format" and words[1:] == ["json"]:
        session.format = "json"
        print("Set format to 'json' mode.")
    elif what in ("verbose", "quiet"):
        session.verbose = what == "verbose"
        print(f"Set '{what}' mode.")
    elif what in ("history", "nohistory"):
        history.enabled = what == "history"
        print(f"Set '{what}' mode.")
    else:
        print("Usage: /set parameter NAME VALUE | system TEXT | format json | verbose | quiet | history | nohistory")


def _unset(session, words: list[str]) -> None:
    if words[:1] == ["parameter"] and len(words) == 2:
        session.options.pop(words[1].lower(), None)
        print(f"Unset parameter '{words[1].lower()}'")
    elif words == ["system"]:
        session.system = None
        print("Unset system message.")
    elif words == ["format"]:
        session.format = None
        print("Disabled format.")
    else:
        print("Usage: /unset parameter NAME | system | format")


def _show(session, words: list[str]) -> None:
    if len(words) != 1 or words[0] not in SHOW_WHAT:
        print(f"Usage: /show {' | '.join(SHOW_WHAT)}")
        return
    data = call("POST", "/api/show", {"model": session.model})
    what = words[0]
    if what == "info":
        print_model_info(data)
    elif what == "parameters":
        # the model's own options with this session's on top: what a message now runs with
        print(parameters_text({**_model_options(data), **session.options}) or "No parameters were specified.")
    elif what == "system":
        print(session.system if session.system is not None else data.get("system") or "No system message.")
    else:
        print(data.get(what) or f"No {what} was specified.")


def _model_options(show: dict) -> dict:
    """The options /api/show's `parameters` text lists, back as a mapping (a repeated name is a list)."""
    options: dict = {}
    for line in show.get("parameters", "").splitlines():
        name, _, value = line.partition(" ")
        value = json.loads(value.strip())
        if name in options:
            options[name] = [*(options[name] if isinstance(options[name], list) else [options[name]]), value]
        else:
            options[name] = [value] if name == "stop" else value
    return options


def set_parameter(session, words: list[str]) -> str:
    """`/set parameter NAME VALUE...` (stop takes several words); the line to print."""
    if len(words) < 2:
        return "Usage: /set parameter NAME VALUE"
    name, values = words[0].lower(), words[1:]
    try:
        typed = [option_from_text(name, v, "/set parameter") for v in values]
    except OptionError as e:
        return str(e)
    session.options[name] = [v for t in typed for v in t] if name == "stop" else typed[0]
    return f"Set parameter '{name}' to '{', '.join(values)}'"
