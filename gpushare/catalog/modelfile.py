"""Ollama's Modelfile: parse one into a base (FROM) and a ModelPreset, and write one back.

The grammar is Ollama's (its parser/parser.go): one ``INSTRUCTION arguments`` per line,
instructions in any case, ``#`` comment lines, an argument either bare (the rest of the line),
in double quotes or in triple quotes, both across lines, without escapes: an argument ends at
the first line end where what it holds so far is bare or a whole quoted string. Writing one
back picks the first form that reads back as the value alone; a value none can hold (a line of
it ends in a closing quote) is refused, so a SYSTEM can never add a FROM. Instructions: FROM (required: a GGUF file, a Hugging Face
folder or a model's name), PARAMETER name value (repeatable; `stop` accumulates), SYSTEM,
TEMPLATE (Jinja here; a Go template is refused), MESSAGE role content, LICENSE (repeatable), and
ADAPTER (once: a LoRA adapter, a PEFT folder or a GGUF LoRA, served on FROM's model). Every error
names the file and the line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpushare.settings.model_options import ROLES, ModelPreset, OptionError, check_template, option_from_text

INSTRUCTIONS = ("FROM", "PARAMETER", "SYSTEM", "TEMPLATE", "MESSAGE", "LICENSE", "ADAPTER")


class ModelfileError(ValueError):
    """A Modelfile gpushare cannot take; the message starts with FILE:LINE."""


@dataclass
class Modelfile:
    base: str  # FROM: a path or a model name, as written
    preset: ModelPreset = field(default_factory=ModelPreset)
    adapter: str | None = None  # ADAPTER: a path, as written


class _Reader:
    """Walks the text, tracking the line number for error messages."""

    def __init__(self, text: str, where: str):
        self.text, self.where, self.pos, self.line = text, where, 0, 1

    def error(self, message: str, line: int | None = None) -> ModelfileError:
        return ModelfileError(f"{self.where}:{line or self.line}: {message}")

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def skip_blanks(self, newlines: bool) -> None:
        while not self.at_end() and self.text[self.pos] in (" \t\r\n" if newlines else " \t\r"):
            self.line += self.text[self.pos] == "\n"
            self.pos += 1

    def rest_of_line(self) -> str:
        end = self.text.find("\n", self.pos)
        end = len(self.text) if end < 0 else end
        value, self.pos = self.text[self.pos:end], end
        return value

    def word(self) -> str:
        start = self.pos
        while not self.at_end() and not self.text[self.pos].isspace():
            self.pos += 1
        return self.text[start:self.pos]

    def argument(self) -> str:
        """The argument that starts here, read as Ollama reads it (read_argument)."""
        start_line = self.line
        read = read_argument(self.text, self.pos)
        if read is None:
            what = '"""' if self.text.startswith('"""', self.pos) else "quoted"
            raise self.error(f"a {what} argument is never closed", start_line)
        value, end = read
        self.line += self.text.count("\n", self.pos, end)
        self.pos = end
        return value


def _line_end(text: str, start: int) -> int:
    ends = [i for i in (text.find("\n", start), text.find("\r", start)) if i >= 0]
    return min(ends) if ends else len(text)


def _unquote(s: str) -> str | None:
    """Ollama's unquote: a whole \"\"\"triple\"\"\" or "double" quoted string without its quotes, a bare
    one as is; None while a quote is still open. There are no escapes."""
    if s.startswith('"""'):
        return s[3:-3] if len(s) >= 6 and s.endswith('"""') else None
    if s.startswith('"'):
        return s[1:-1] if len(s) >= 2 and s.endswith('"') else None
    return s


def read_argument(text: str, start: int) -> tuple[str, int] | None:
    """(value, end) of the argument at ``start``, as Ollama's parser reads it: it runs to the first line
    end (or the end of the text) where what it holds so far, stripped, unquotes; None if none does."""
    end = start
    while True:
        end = _line_end(text, end)
        value = _unquote(text[start:end].strip())
        if value is not None:
            return value, end
        if end >= len(text):
            return None
        end += 1


def parse_modelfile(text: str, where: str = "Modelfile") -> Modelfile:
    """The Modelfile in `text`; `where` (its path) prefixes every error."""
    r = _Reader(text, where)
    base, adapter, preset, licenses = None, None, ModelPreset(), []
    while True:
        r.skip_blanks(newlines=True)
        if r.at_end():
            break
        if r.text[r.pos] == "#":
            r.rest_of_line()
            continue
        line, instruction = r.line, r.word()
        if instruction.upper() not in INSTRUCTIONS:
            raise r.error(f"unknown instruction {instruction!r} (known: {', '.join(INSTRUCTIONS)})")
        instruction = instruction.upper()
        r.skip_blanks(newlines=False)
        name = r.word() if instruction in ("PARAMETER", "MESSAGE") else None
        r.skip_blanks(newlines=False)
        value = r.argument()
        if instruction not in ("LICENSE", "SYSTEM") and not value:
            raise r.error(f"{instruction} needs {'a value' if name else 'an argument'}", line)
        try:
            if instruction == "FROM":
                base = value
            elif instruction == "PARAMETER":
                typed = option_from_text(name, value, f"{where}:{line}")
                key = name.lower()
                preset.options[key] = preset.options.get(key, []) + typed if key == "stop" else typed
            elif instruction == "SYSTEM":
                preset.system = value
            elif instruction == "TEMPLATE":
                preset.template = check_template(value, f"{where}:{line}")
            elif instruction == "MESSAGE":
                if name.lower() not in ROLES:
                    raise r.error(f"MESSAGE role must be one of {', '.join(ROLES)}, got {name!r}", line)
                preset.messages.append({"role": name.lower(), "content": value})
            elif instruction == "LICENSE":
                licenses.append(value)
            elif adapter is not None:
                raise r.error("a second ADAPTER: a model serves one LoRA adapter", line)
            else:
                adapter = value
        except OptionError as e:
            raise ModelfileError(str(e)) from None
    if base is None:
        raise ModelfileError(f"{where}: no FROM line; a Modelfile must say which model it builds on")
    if licenses:
        preset.license = "\n".join(licenses)
    return Modelfile(base, preset, adapter)


def _quoted(value: str) -> str:
    """An argument as written back: bare, "quoted" or \"\"\"triple-quoted\"\"\", the first that Ollama's parser
    (read_argument) reads back as ``value`` and nothing more. Some values none can (a line of one ending
    in three quotes): a ModelfileError, never a Modelfile that reads as other instructions."""
    candidates = [f'"{value}"', f'"""{value}"""']
    if value and value == value.strip() and not value.startswith(('"', "#")):
        candidates.insert(0, value)
    for text in candidates:
        if read_argument(text + "\n", 0) == (value, len(text)):
            return text
    shown = value if len(value) <= 40 else value[:40] + "..."
    raise ModelfileError(f"the value {shown!r} cannot be written in a Modelfile: Ollama's grammar has no escapes, "
                         'and a line of it ends in a closing quote (" or """)')


def format_modelfile(base: str, preset: ModelPreset, name: str | None = None, adapter: str | None = None) -> str:
    """The Modelfile that rebuilds `preset` (and `adapter`) on `base`, as `ollama show --modelfile` prints it."""
    lines = []
    if name:
        lines += ['# Modelfile generated by "gpushare show"', "# To build a new Modelfile based on this, replace FROM "
                  "with:", f"# FROM {name}", ""]
    lines.append(f"FROM {_quoted(base)}")
    if adapter is not None:
        lines.append(f"ADAPTER {_quoted(adapter)}")
    if preset.template is not None:
        lines.append(f"TEMPLATE {_quoted(preset.template)}")
    if preset.system is not None:
        lines.append(f"SYSTEM {_quoted(preset.system)}")
    for key, value in preset.options.items():
        for item in value if isinstance(value, list) else [value]:
            text = item if isinstance(item, str) else str(item).lower() if isinstance(item, bool) else \
                str(int(item)) if isinstance(item, float) and item.is_integer() else str(item)
            lines.append(f"PARAMETER {key} {_quoted(text)}")
    for m in preset.messages:
        lines.append(f"MESSAGE {m['role']} {_quoted(m['content'])}")
    if preset.license is not None:
        lines.append(f"LICENSE {_quoted(preset.license)}")
    return "\n".join(lines) + "\n"
