"""A pull: a name's manifest, checked, then its blobs into the store, then the manifest; shared by all who ask.

The steps and their progress are Ollama's: `pulling manifest`, then each layer (`pulling
<digest>` with `total` and `completed`), `verifying sha256 digest`, `writing manifest`,
`success`. Before a byte is fetched the manifest is checked (digests are `sha256:<hex>`,
sizes are counts, one GGUF layer, at most MAX_LAYERS, small text layers) and so is the free
disk space for what is not already in the store. The manifest's layers become the model's
parts as in Ollama's store (ollama_store.read_manifest): the GGUF is the weights; params,
system, messages and license are its defaults; the Go template is kept but not run (the
GGUF's own Jinja template is); a projector (mmproj) layer is refused by name. An adapter layer
(a GGUF LoRA) is fetched like the model layer: the model is that adapter on those weights.
An `hf.co/...` name whose repo has no GGUF is fetched as a safetensors folder (hf_pull.py).
Pulls of one name at once share one Pull; when the last watcher leaves it is cancelled, and
what it had written stays for the next try to resume. Pulls of different names that need the same
blob share its download (`Fetching`: one fetches it, the others show its progress and wait, and
fetch it themselves only if that pull ends without it). At most `max_pulls()` pulls run at once
(server.max_pulls: each runs a process and a download); one more waits its turn, its watchers
seeing a `queued` line, in the order they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.catalog import blob_store, pull_child
from gpushare.catalog.blob_download import LayerProgress
from gpushare.catalog.blob_store import StoreError, check_digest
from gpushare.catalog.hf_pull import pull_folder
from gpushare.catalog.names import PullName
from gpushare.catalog.pull_child import download, verify
from gpushare.catalog.registry_client import Remote, RegistryError, fetch_manifest, new_session
from gpushare.settings.settings import ServerSettings

log = logging.getLogger("gpushare.pull")

MEDIA = "application/vnd.ollama.image."
DEFAULTS_LAYERS = ("params", "system", "messages", "license", "template")
REFUSED_LAYERS = {"projector": "a vision projector (mmproj) layer: images are not supported yet"}
MAX_LAYERS = 64
MAX_TEXT_LAYER_BYTES = 1 << 20  # what ollama_store reads of a params/system/template/license layer


class PullError(Exception):
    """A pull that cannot go on; `status` is the HTTP status it answers with before streaming."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Pull:
    name: PullName
    status: str = "pulling manifest"
    layers: list[LayerProgress] = field(default_factory=list)
    checked: asyncio.Event = field(default_factory=asyncio.Event)  # manifest read and checked, space is there
    queued: str | None = None  # while it waits for a turn (server.max_pulls): why, for its watchers
    answering: asyncio.Event = field(default_factory=asyncio.Event)  # checked, or queued: watchers see lines
    task: asyncio.Task | None = None
    watchers: int = 0
    steps: list[str] = field(default_factory=list)  # every status it went through, for watchers to replay

    def step(self, status: str) -> None:
        self.status = status
        self.steps.append(status)

    def mark_checked(self) -> None:
        self.checked.set()
        self.answering.set()


class Fetching:
    """The blobs pulls are fetching now, by digest: the fetching pull's progress and a future done when
    it stops (with the blob in the store, or not). A second pull needing one waits on it instead of
    downloading it into the same partial file."""

    def __init__(self):
        self.by_digest: dict[str, tuple[LayerProgress, asyncio.Future]] = {}
        self.folders: dict[Path, asyncio.Future] = {}

    @contextlib.asynccontextmanager
    async def alone(self, folder: Path):
        """The body runs with no other pull using ``folder`` (a Hugging Face staging folder, shared by
        two names of one commit): it waits for one that is."""
        while folder in self.folders:
            await asyncio.wait({self.folders[folder]})
        done = self.folders[folder] = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            del self.folders[folder]
            done.set_result(None)


def check_manifest(body: bytes, name: PullName) -> list[tuple[str, str, int]]:
    """(media type, digest, size) of the config and every layer; PullError naming what is wrong."""
    where = f'the manifest of "{name.display}"'
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise PullError(f"{where} is not JSON: {e}") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list) or not layers:
        raise PullError(f'{where} has no "layers" list')
    if len(layers) > MAX_LAYERS:
        raise PullError(f"{where} has {len(layers)} layers, over the {MAX_LAYERS} a model may have")
    entries = ([doc["config"]] if isinstance(doc.get("config"), dict) else []) + layers
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("mediaType"), str):
            raise PullError(f"{where}: a layer without a mediaType")
        media, size = entry["mediaType"], entry.get("size")
        try:
            digest = check_digest(entry.get("digest"))
        except StoreError as e:
            raise PullError(f"{where}: {media}: {e}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PullError(f"{where}: {media} {digest}: size must be a byte count, got {size!r}")
        out.append((media, digest, size))
    kinds = [media.removeprefix(MEDIA) for media, _, _ in out[-len(layers):]]
    for kind, (media, digest, size) in zip(kinds, out[-len(layers):]):
        if kind in REFUSED_LAYERS:
            raise PullError(f'"{name.display}" has {REFUSED_LAYERS[kind]} ({media})')
        if kind not in ("model", "adapter") and kind not in DEFAULTS_LAYERS:
            raise PullError(f'"{name.display}" has a layer gpushare does not know: {media}')
        if kind not in ("model", "adapter") and size > MAX_TEXT_LAYER_BYTES:
            raise PullError(f"{where}: the {kind} layer is {size} bytes, over {MAX_TEXT_LAYER_BYTES}")
    if kinds.count("model") != 1:
        raise PullError(f"{where} has {kinds.count('model')} GGUF ({MEDIA}model) layers; a model needs one")
    if len(out) > len(layers) and out[0][2] > MAX_TEXT_LAYER_BYTES:
        raise PullError(f"{where}: the config blob is {out[0][2]} bytes, over {MAX_TEXT_LAYER_BYTES}")
    return out


def bytes_to_fetch(root: Path, blobs: list[tuple[str, str, int]]) -> int:
    """What the store still needs of these blobs (a partial's written bytes are there already)."""
    needed = 0
    for _, digest, size in dict.fromkeys(blobs):
        if not blob_store.has_blob(root, digest, size):
            partial = blob_store.read_partial(root, digest, size)
            needed += size - (partial.written if partial else 0)
    return needed


async def _pull_manifest(pull: Pull, root: Path, remote: Remote, body: bytes, cap_of, fetching: Fetching) -> None:
    blobs = check_manifest(body, pull.name)
    if any(media == MEDIA + "template" for media, _, _ in blobs):
        log.info("%s: its Go template layer is kept but not run; the GGUF's own chat template is used",
                 pull.name.display)
    blob_store.check_free_space(root, bytes_to_fetch(root, blobs))
    unique = list(dict.fromkeys((digest, size) for _, digest, size in blobs))
    pull.layers = [LayerProgress(digest, size) for digest, size in unique]
    pull.step("downloading")
    pull.mark_checked()
    await _fetch_layers(pull, root, remote, cap_of, fetching)
    if "verifying sha256 digest" not in pull.steps:
        pull.step("verifying sha256 digest")
    pull.step("writing manifest")
    blob_store.write_manifest(root, pull.name.parts, body)


async def _fetch_layers(pull: Pull, root: Path, remote: Remote, cap_of, fetching: Fetching) -> None:
    """Each layer into the store: fetched and verified by this pull, or by another fetching it now (its
    progress shown as this pull's), until all are there."""
    while True:
        missing = []
        for i, layer in enumerate(pull.layers):
            if blob_store.has_blob(root, layer.digest, layer.total):
                layer.completed = layer.total
            elif layer.digest in fetching.by_digest:
                pull.layers[i] = fetching.by_digest[layer.digest][0]  # theirs: its progress is ours
                missing.append(layer)
            else:
                missing.append(layer)
        if not missing:
            return
        mine = [layer for layer in missing if layer.digest not in fetching.by_digest]
        theirs = {fetching.by_digest[layer.digest][1] for layer in missing if layer.digest in fetching.by_digest}
        done = asyncio.get_running_loop().create_future()
        for layer in mine:
            fetching.by_digest[layer.digest] = (layer, done)
        try:
            if mine:
                await download(remote, root, mine, cap_of)
                if "verifying sha256 digest" not in pull.steps:
                    pull.step("verifying sha256 digest")
                await verify(root, mine)
        except StoreError:  # the disk is full: give back what this pull took, none of it is a model yet
            for layer in mine:
                blob_store.discard_partial(root, layer.digest)
            raise
        finally:
            for layer in mine:
                fetching.by_digest.pop(layer.digest, None)
            done.set_result(None)
        if theirs:
            await asyncio.wait(theirs)  # then look again: a pull that failed left its blobs to us


async def run_pull(pull: Pull, root: Path, cap_of=lambda: None, fetching: Fetching | None = None) -> None:
    """The whole pull; raises PullError (with the HTTP status for the API) on any failure. ``cap_of()``:
    the bytes per second its download may take now (None: no cap; pull_child.py); ``fetching``: the
    blobs other pulls are fetching now."""
    fetching = fetching or Fetching()
    try:
        async with new_session() as session:
            remote = Remote(pull.name, session)
            try:
                body = await fetch_manifest(remote)
            except RegistryError as e:
                if not (pull.name.is_hf and 400 <= e.status < 500 and e.status not in (401, 403)):
                    raise
                await pull_folder(pull, root, remote, e, cap_of, fetching)  # an HF repo of safetensors, not GGUF
            else:
                await _pull_manifest(pull, root, remote, body, cap_of, fetching)
        pull.step("success")
        log.info("pulled %s", pull.name.display)
    except RegistryError as e:
        raise PullError(str(e), e.status if 400 <= e.status < 500 else 502) from None
    except StoreError as e:
        raise PullError(str(e), 400 if not pull.checked.is_set() else 500) from None
    except pull_child.ChildDied as e:
        raise PullError(str(e), 500) from None


class Pulls:
    """The pulls under way, one per name: a second ask for a name joins the first; at most ``max_of()``
    run at once, the others wait their turn."""

    def __init__(self, root_of, cap_of=lambda: None, max_of=lambda: ServerSettings.max_pulls):
        self._root_of = root_of  # () -> models_dir: the config may be reloaded
        self._cap_of = cap_of  # () -> bytes per second a download may take now, or None
        self._max_of = max_of  # () -> pulls that may run at once (server.max_pulls)
        self.running: dict[tuple, Pull] = {}
        self.fetching = Fetching()
        self._active = 0
        self._turns: list[asyncio.Future] = []  # the waiting pulls' wake-ups, first come first

    def get(self, name: PullName) -> Pull | None:
        return self.running.get(name.parts)

    def start(self, name: PullName) -> Pull:
        pull = self.running.get(name.parts)
        if pull is None:
            pull = self.running[name.parts] = Pull(name)
            pull.task = asyncio.ensure_future(self._run(pull))
            pull.task.add_done_callback(lambda _: self.running.pop(name.parts, None))
        return pull

    async def _run(self, pull: Pull) -> None:
        while self._active >= max(1, self._max_of()) or (self._turns and not pull.queued):
            pull.queued = f"queued: {self._active} pulls under way, server.max_pulls {self._max_of()}"
            pull.answering.set()
            turn = asyncio.get_running_loop().create_future()
            self._turns.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # woken, then cancelled: the turn passes on
                    self._wake_next()
                raise
            finally:
                if turn in self._turns:
                    self._turns.remove(turn)
        self._active += 1
        pull.queued = None
        if self._active < self._max_of():  # a reload may have raised the cap
            self._wake_next()
        try:
            await run_pull(pull, Path(self._root_of()), self._cap_of, self.fetching)
        finally:
            self._active -= 1
            self._wake_next()

    def _wake_next(self) -> None:
        """The first in line looks again whether it may run."""
        for turn in self._turns:
            if not turn.done():
                turn.set_result(None)
                return

    def leave(self, pull: Pull) -> None:
        """A watcher left; the last one cancels the pull (its partial files stay, to resume)."""
        pull.watchers -= 1
        if pull.watchers <= 0 and pull.task is not None and not pull.task.done():
            pull.task.cancel()

    async def close(self) -> None:
        tasks = [p.task for p in self.running.values() if p.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
