"""A model's presets: default options, system prompt, template, messages and license.

They come from an Ollama manifest's params/system/template/messages/license layers, a
Modelfile (PARAMETER, SYSTEM, TEMPLATE, MESSAGE, LICENSE) or the config
(`models[].options`, `models[].system`), and sit under a request's own options: a request
that sets `temperature` wins over the model's, one that does not gets the model's.

Option names and types are Ollama's. The ones the engine has no use for (num_gpu,
mirostat, ...) are accepted and kept, as Ollama's API accepts them, but change nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# Ollama's option names -> the JSON type of their value ("string list": `stop`, one string per PARAMETER line).
OPTION_TYPES = {
    "num_ctx": "integer", "num_predict": "integer", "num_keep": "integer", "seed": "integer", "top_k": "integer",
    "repeat_last_n": "integer", "mirostat": "integer", "num_batch": "integer", "num_gpu": "integer",
    "main_gpu": "integer", "num_thread": "integer",
    "temperature": "number", "top_p": "number", "min_p": "number", "typical_p": "number", "repeat_penalty": "number",
    "presence_penalty": "number", "frequency_penalty": "number", "mirostat_tau": "number", "mirostat_eta": "number",
    "penalize_newline": "boolean", "use_mmap": "boolean", "use_mlock": "boolean", "low_vram": "boolean",
    "numa": "boolean", "f16_kv": "boolean", "vocab_only": "boolean", "logits_all": "boolean",
    "stop": "string list",
    # older Ollama releases wrote these into params layers; accepted as the rest
    "tfs_z": "number", "num_gqa": "integer", "rope_frequency_base": "number", "rope_frequency_scale": "number",
}
# What the engine acts on; the rest of OPTION_TYPES is accepted and changes nothing.
APPLIED_OPTIONS = ("num_ctx", "num_predict", "seed", "top_k", "temperature", "top_p", "min_p", "repeat_penalty",
                   "presence_penalty", "frequency_penalty", "stop")
ROLES = ("system", "user", "assistant", "tool")
# Go text/template actions as Ollama's TEMPLATEs write them ({{ .System }}, {{ if .Prompt }}, {{ range ... }}):
# never valid Jinja, which reads variables without a leading dot and writes statements as {% ... %}.
_GO_ACTION = re.compile(r"\{\{-?\s*(\.|\$|(if|range|with|define|block|template)\s|(else|end)\s*-?\}\})")


class OptionError(ValueError):
    """A bad option name or value; the message names where it came from."""


@dataclass
class ModelPreset:
    options: dict = field(default_factory=dict)  # Ollama option name -> typed value
    system: str | None = None
    template: str | None = None  # Jinja; None: the model file's own chat template
    messages: list[dict] = field(default_factory=list)  # {"role", "content"} put before every chat's messages
    license: str | None = None

    def is_empty(self) -> bool:
        return self == ModelPreset()

    def over(self, base: ModelPreset) -> ModelPreset:
        """This preset on top of `base` (a Modelfile FROM an existing model): set values win, options merge."""
        return ModelPreset({**base.options, **self.options}, self.system if self.system is not None else base.system,
                           self.template if self.template is not None else base.template,
                           self.messages or base.messages, self.license if self.license is not None else base.license)


def option_value(name: str, value, where: str):
    """A typed option value as JSON gives it (params layer, config, /api/create); raises OptionError."""
    kind = OPTION_TYPES.get(name)
    if kind is None:
        raise OptionError(f"{where}: unknown parameter {name!r} (known: {', '.join(sorted(OPTION_TYPES))})")
    if kind == "string list":
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise OptionError(f"{where}: {name} must be a string or a list of strings, got {value!r}")
        return list(values)
    ok = {"integer": isinstance(value, int) or isinstance(value, float) and value.is_integer(),
          "number": isinstance(value, (int, float)),
          "boolean": isinstance(value, bool)}[kind]
    if not ok or (kind != "boolean" and isinstance(value, bool)):
        raise OptionError(f"{where}: {name} must be {'an' if kind == 'integer' else 'a'} {kind}, got {value!r}")
    return int(value) if kind == "integer" else float(value) if kind == "number" else value


def option_from_text(name: str, text: str, where: str):
    """A PARAMETER line's value (always text) typed by the option's kind."""
    kind = OPTION_TYPES.get(name.lower())
    if kind is None:
        raise OptionError(f"{where}: unknown parameter {name!r} (known: {', '.join(sorted(OPTION_TYPES))})")
    if kind == "string list":
        return [text]
    try:
        value = {"integer": int, "number": float}[kind](text) if kind != "boolean" else \
            {"true": True, "false": False}[text.lower()]
    except (ValueError, KeyError):
        raise OptionError(f"{where}: {name} must be {'an' if kind == 'integer' else 'a'} {kind}, "
                          f"got {text!r}") from None
    return value


def options_from_json(raw, where: str) -> dict:
    """An options mapping (params layer, `models[].options`, /api/create `parameters`), checked and typed."""
    if not isinstance(raw, dict):
        raise OptionError(f"{where}: must be a mapping of option names to values, got {type(raw).__name__}")
    return {name: option_value(name, value, f"{where}.{name}") for name, value in raw.items()}


def messages_from_json(raw, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise OptionError(f"{where}: must be a list of {{role, content}} messages, got {type(raw).__name__}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
            raise OptionError(f"{where}[{i}]: must be {{\"role\": one of {', '.join(ROLES)}, \"content\": text}}, "
                              f"got {m!r}")
        out.append({"role": m["role"], "content": m.get("content", "")})
    return out


def check_template(template: str, where: str) -> str:
    """A TEMPLATE is Jinja here; Ollama's Go templates are refused with a message saying so."""
    if _GO_ACTION.search(template):
        raise OptionError(f"{where}: this TEMPLATE is a Go template (Ollama's {{{{ .Prompt }}}} syntax); gpushare "
                          f"renders chat templates as Jinja, as Hugging Face does: write it in Jinja "
                          f"({{% for message in messages %}}...), or leave TEMPLATE out to use the model file's own")
    return template


def go_value(value) -> str:
    """A value as Go's %#v prints it in Ollama's `parameters` text: strings quoted, numbers bare."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def parameters_text(options: dict) -> str:
    """/api/show's `parameters`: one `name value` line per value (a list gives a line per item)."""
    lines = []
    for name, value in options.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append(f"{name:<30} {go_value(item)}")
    return "\n".join(lines)
