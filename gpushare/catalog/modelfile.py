"""Ollama's Modelfile: parse one into a base (FROM) and a ModelPreset, and write one back.

The grammar is Ollama's: one ``INSTRUCTION arguments`` per line, instructions in any case,
``#`` comment lines, an argument either bare (the rest of the line), in double quotes, or
in triple quotes across lines. Instructions: FROM (required: a GGUF file, a Hugging Face
folder or a model's name), PARAMETER name value (repeatable; `stop` accumulates), SYSTEM,
TEMPLATE (Jinja here; a Go template is refused), MESSAGE role content, LICENSE (repeatable).
ADAPTER is refused (no LoRA). Every error names the file and the line.
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
        """A bare, "quoted" or \"\"\"triple-quoted\"\"\" argument; the line must end after it."""
        start_line = self.line
        if self.text.startswith('"""', self.pos):
            end = self.text.find('"""', self.pos + 3)
            if end < 0:
                raise self.error('a """ argument is never closed', start_line)
            value = self.text[self.pos + 3:end]
            self.line += value.count("\n")
            self.pos = end + 3
        elif self.text.startswith('"', self.pos):
            chars, i = [], self.pos + 1
            while i < len(self.text) and self.text[i] not in '"\n':
                if self.text[i] == "\\" and i + 1 < len(self.text) and self.text[i + 1] in '"\\':
                    i += 1
                chars.append(self.text[i])
                i += 1
            if i >= len(self.text) or self.text[i] != '"':
                raise self.error("a quoted argument is never closed on its line")
            value, self.pos = "".join(chars), i + 1
        else:
            return self.rest_of_line().strip()
        trailing = self.rest_of_line().strip()
        if trailing:
            raise self.error(f"unexpected {trailing!r} after the closing quote")
        return value


def parse_modelfile(text: str, where: str = "Modelfile") -> Modelfile:
    """The Modelfile in `text`; `where` (its path) prefixes every error."""
    r = _Reader(text, where)
    base, preset, licenses = None, ModelPreset(), []
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
            else:
                raise r.error("ADAPTER is not supported: gpushare does not apply LoRA adapters; merge the adapter "
                              "into the weights first", line)
        except OptionError as e:
            raise ModelfileError(str(e)) from None
    if base is None:
        raise ModelfileError(f"{where}: no FROM line; a Modelfile must say which model it builds on")
    if licenses:
        preset.license = "\n".join(licenses)
    return Modelfile(base, preset)


def _quoted(value: str) -> str:
    """An argument as written back: bare when the rest of a line reads it back as is, else quoted."""
    if "\n" in value:
        return f'"""{value}"""'
    if value and value == value.strip() and not value.startswith(('"', "#")):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def format_modelfile(base: str, preset: ModelPreset, name: str | None = None) -> str:
    """The Modelfile that rebuilds `preset` on `base`, as `ollama show --modelfile` prints it."""
    lines = []
    if name:
        lines += ['# Modelfile generated by "gpushare show"', "# To build a new Modelfile based on this, replace FROM "
                  "with:", f"# FROM {name}", ""]
    lines.append(f"FROM {base}")
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
