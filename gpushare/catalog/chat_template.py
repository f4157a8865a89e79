"""Render a model's own Jinja2 chat template the way Hugging Face's apply_chat_template does."""

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model file carries no template: ChatML, which most small chat models speak.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message):
    raise TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(value, indent=None, **_):
    return json.dumps(value, indent=indent, ensure_ascii=False)


def compile_template(source: str | None):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source or DEFAULT_TEMPLATE)


def render(template, messages: list[dict], bos_token: str | None, eos_token: str | None,
           add_generation_prompt: bool = True, **extra) -> str:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise TemplateError(f"messages[{i}] must be an object with a 'role'")
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "", **extra)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed: {e}") from e
