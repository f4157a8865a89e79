"""`gpushare run`: one prompt (argument or piped stdin), or an interactive chat as `ollama run` has it.

The interactive loop keeps the conversation and takes Ollama's commands: `/set parameter NAME
VALUE`, `/set system`, `/set format json`, `/set verbose|quiet`, `/set history|nohistory`,
`/unset ...`, `/show info|modelfile|parameters|system|template|license`, `/load MODEL`,
`/save MODEL`, `/clear`, `/bye`; a line opening with three double quotes reads on until a
line closing with them. Lines typed are kept in a history file ($GPUSHARE_HISTORY, default
~/.local/share/gpushare/history) across runs. A line starting with `/` is never sent to the
model. The model loads first, with a progress bar on a terminal.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from gpushare.cli.format import keep_alive_value
from gpushare.cli.http_client import ApiFailure, load_with_progress, stream
from gpushare.cli.repl import run_command

HISTORY_FILE = "~/.local/share/gpushare/history"
@dataclass
class Session:
    model: str
    options: dict = field(default_factory=dict)  # Ollama option name -> value, over the model's own
    system: str | None = None
    format: str | None = None
    verbose: bool = False
    keep_alive: str | None = None
    messages: list[dict] = field(default_factory=list)


def session_from_args(args) -> Session:
    options = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed),
                                 ("num_predict", args.max_tokens)) if v is not None}
    return Session(args.model, options, format=args.format, verbose=args.verbose, keep_alive=args.keep_alive)


def chat_once(session: Session, messages: list[dict]) -> str:
    """Stream one answer to stdout; returns its text."""
    system = [{"role": "system", "content": session.system}] if session.system is not None else []
    body = {"model": session.model, "messages": system + messages, "options": session.options}
    if session.format:
        body["format"] = session.format
    if session.keep_alive is not None:
        body["keep_alive"] = keep_alive_value(session.keep_alive)
    parts, final = [], {}
    for chunk in stream("/api/chat", body):
        piece = chunk.get("message", {}).get("content", "")
        parts.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
        if chunk.get("done"):
            final = chunk
    text = "".join(parts)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    if session.verbose and final:
        print_stats(final)
    return text


def print_stats(final: dict) -> None:
    """Ollama's `--verbose` summary, from the final chunk's nanosecond durations."""
    def seconds(key: str) -> float:
        return final[key] / 1e9

    def rate(count_key: str, duration_key: str) -> str:
        return f"{final[count_key] / seconds(duration_key):.2f} tokens/s" if final[duration_key] else "-"

    print(f"total duration:       {seconds('total_duration'):.3f}s\n"
          f"load duration:        {seconds('load_duration'):.3f}s\n"
          f"prompt eval count:    {final['prompt_eval_count']} token(s)\n"
          f"prompt eval duration: {seconds('prompt_eval_duration'):.3f}s\n"
          f"prompt eval rate:     {rate('prompt_eval_count', 'prompt_eval_duration')}\n"
          f"eval count:           {final['eval_count']} token(s)\n"
          f"eval duration:        {seconds('eval_duration'):.3f}s\n"
          f"eval rate:            {rate('eval_count', 'eval_duration')}", file=sys.stderr)


def cmd_run(args) -> int:
    session = session_from_args(args)
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        if piped.strip():
            prompt = f"{prompt}\n\n{piped}" if prompt else piped
    elif not prompt:
        return interactive(session)
    if not prompt.strip():
        raise ApiFailure("the prompt is empty")
    if sys.stderr.isatty():
        load_with_progress(session.model, session.keep_alive)
    chat_once(session, [{"role": "user", "content": prompt}])
    return 0


# ---------------------------------------------------------------------------- the interactive loop

class History:
    """readline's history, kept in a file across runs (when readline is there and history is on)."""

    def __init__(self):
        self.path = os.path.expanduser(os.environ.get("GPUSHARE_HISTORY") or HISTORY_FILE)
        self.enabled = True
        try:
            import readline
        except ImportError:
            self.readline = None
            return
        self.readline = readline
        try:
            readline.read_history_file(self.path)
        except OSError:
            pass

    def save(self) -> None:
        if self.readline is None or not self.enabled:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.readline.write_history_file(self.path)
        except OSError as e:
            print(f"cannot write the history file {self.path}: {e.strerror}", file=sys.stderr)


def read_message(first: str) -> str:
    """A line, or (from an opening \"\"\" to its closing one) several, read on over `... ` lines; the quotes go."""
    text = first
    while text.count('"""') % 2:
        text += "\n" + input("... ")
    return text.replace('"""', "")


def interactive(session: Session) -> int:
    load_with_progress(session.model, session.keep_alive)  # fail early (404) and pay the load now
    history = History()
    print("Type /? for help, /bye to exit.", file=sys.stderr)
    while True:
        try:
            line = read_message(input(">>> "))
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.")
            continue
        history.save()
        if line.strip().startswith("/"):
            if run_command(session, history, line.strip()) == "bye":
                return 0
            continue
        if not line.strip():
            continue
        session.messages.append({"role": "user", "content": line})
        try:
            answer = chat_once(session, session.messages)
        except KeyboardInterrupt:  # closing the stream cancels the request in the daemon
            print()
            session.messages.pop()
            continue
        except ApiFailure as e:
            print(f"Error: {e}", file=sys.stderr)
            session.messages.pop()
            continue
        session.messages.append({"role": "assistant", "content": answer})
