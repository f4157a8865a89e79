"""With tenants, starting a pull and uploading blobs are admin-only, and anyone may watch a pull under way
(the API in-process, no model loaded; a registry on 127.0.0.1 from registry_fixture.py)."""

import asyncio
import json
import time

from aiohttp.test_utils import TestClient, TestServer

from gpushare.api.app import build_app
from gpushare.api.context import ApiContext
from gpushare.engine.engine import Engine
from gpushare.engine.local_device import LocalDevice
from gpushare.residency.node_devices import NodeDevices
from gpushare.residency.registry import Registry
from gpushare.settings.settings import parse_settings
from registry_fixture import Registry as ModelRegistry, Serving

TENANTS = [{"name": "ops", "api_keys": ["ops-key"], "admin": True}, {"name": "alice", "api_keys": ["alice-key"]}]


def key(name: str) -> dict:
    return {"Authorization": f"Bearer {name}-key"}


def test_only_admins_start_pulls_or_upload_blobs_and_anyone_watches_one(tmp_path):
    models = ModelRegistry()
    manifest = models.add_model("library", "tiny", "q4", b"GGUF" + bytes(range(256)) * 1024)
    slow_once = []
    models.on_blob = lambda digest: slow_once or (slow_once.append(digest), time.sleep(1.5))  # time to join
    server = Serving(models)
    settings = parse_settings({"models": [], "models_dir": str(tmp_path / "models"), "tenants": TENANTS}, env={})
    devices = {"cpu": LocalDevice(Engine())}
    app = build_app(ApiContext(NodeDevices(devices), Registry(devices, settings, dtype="float32"), settings))
    name = f"{models.host}/library/tiny:q4"

    async def scenario():
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/api/pull", json={"model": name, "insecure": True}, headers=key("alice"))
            assert resp.status == 403 and "may not pull models" in (await resp.json())["error"]
            resp = await client.post(f"/api/blobs/sha256:{'0' * 64}", data=b"x", headers=key("alice"))
            assert resp.status == 403 and "may not upload blobs" in (await resp.json())["error"]
            assert not models.requests  # nothing was fetched for alice

            async def pull(who: str) -> list[dict]:
                resp = await client.post("/api/pull", json={"model": name, "insecure": True}, headers=key(who))
                assert resp.status == 200, await resp.text()
                return [json.loads(line) for line in (await resp.text()).splitlines()]

            admin = asyncio.ensure_future(pull("ops"))
            while not models.requests:
                await asyncio.sleep(0.05)
            watcher = await pull("alice")
            assert watcher[-1] == {"status": "success"} and (await admin)[-1] == {"status": "success"}
            assert any(line.get("digest") == manifest["layers"][0]["digest"] for line in watcher)
            assert len(models.blob_requests(manifest["layers"][0]["digest"])) == 1
            resp = await client.delete("/api/delete", json={"model": name}, headers=key("alice"))
            assert resp.status == 403
            tags = await (await client.get("/api/tags", headers=key("ops"))).json()
            assert name in [m["name"] for m in tags["models"]]

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
