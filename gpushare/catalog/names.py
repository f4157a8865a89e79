"""Model names as `ollama pull` takes them, and where each one is fetched from.

`name[:tag]` is `registry.ollama.ai/library/name:tag`; `namespace/name[:tag]` is another
namespace there; `host[:port]/namespace/name[:tag]` is that registry. `hf.co/<user>/<repo>[:<quant>]`
and `huggingface.co/...` are Hugging Face's registry endpoint for these names, reached through
`HF_ENDPOINT` when it is set (as huggingface_hub does) and sent `HF_TOKEN` when that is set.
The tag defaults to `latest`. Every part is checked here, once: a part becomes a folder of the
store (`manifests/<host>/<namespace>/<name>/<tag>`), so `..`, slashes and odd characters never
reach a path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
HF_HOSTS = ("hf.co", "huggingface.co")
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}(:[0-9]{1,5})?")


class BadName(ValueError):
    """A name that is not `[host/][namespace/]name[:tag]`; the message says which part is wrong."""


@dataclass(frozen=True)
class PullName:
    host: str  # as written, with its port: the store's folder and the listed name's prefix
    namespace: str
    model: str
    tag: str
    base_url: str  # scheme://host[:port] the registry answers on
    token: str | None = None  # a bearer token to send (HF_TOKEN for Hugging Face names)

    @property
    def is_hf(self) -> bool:
        return self.host in HF_HOSTS

    @property
    def repository(self) -> str:
        return f"{self.namespace}/{self.model}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """The manifest's path under manifests/ in the store."""
        return self.host, self.namespace, self.model, self.tag

    @property
    def display(self) -> str:
        """As `list` shows it (ollama_store.model_name)."""
        if self.host == DEFAULT_REGISTRY:
            prefix = "" if self.namespace == DEFAULT_NAMESPACE else f"{self.namespace}/"
            return f"{prefix}{self.model}:{self.tag}"
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"


def _check(part: str, what: str, name: str, pattern=_PART) -> str:
    if not pattern.fullmatch(part) or ".." in part:
        raise BadName(f"invalid model name {name!r}: the {what} {part!r} must be letters, digits, '.', '_' "
                         f"or '-' (not starting with one of those three)")
    return part


def hf_endpoint(env: dict | None = None) -> str:
    """Hugging Face's base URL: HF_ENDPOINT when set, as huggingface_hub reads it."""
    env = os.environ if env is None else env
    return (env.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")


def parse_name(name: str, insecure: bool = False, env: dict | None = None) -> PullName:
    """Where `name` comes from; `insecure` allows plain HTTP to a registry named in it."""
    env = os.environ if env is None else env
    raw = name.strip()
    if not raw:
        raise BadName("a model name is required")
    if "@" in raw:
        raise BadName(f"invalid model name {name!r}: pulling by digest (@sha256:...) is not supported")
    path, _, tag = raw.rpartition(":") if ":" in raw.rsplit("/", 1)[-1] else (raw, "", DEFAULT_TAG)
    tag = _check(tag or DEFAULT_TAG, "tag", name)
    parts = path.split("/")
    if len(parts) == 1:
        host, namespace, model = DEFAULT_REGISTRY, DEFAULT_NAMESPACE, parts[0]
    elif len(parts) == 2:
        host, (namespace, model) = DEFAULT_REGISTRY, parts
    elif len(parts) == 3:
        host, namespace, model = parts
        _check(host, "registry host", name, _HOST)
    else:
        raise BadName(f"invalid model name {name!r}: expected [host/][namespace/]name[:tag]")
    _check(namespace, "namespace", name)
    _check(model, "model name", name)
    host = host.lower()
    if host in HF_HOSTS:
        return PullName(host, namespace, model, tag, hf_endpoint(env), env.get("HF_TOKEN") or None)
    scheme = "http" if insecure else "https"
    return PullName(host, namespace, model, tag, f"{scheme}://{host}")
