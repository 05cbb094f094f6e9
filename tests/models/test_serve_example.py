"""examples/serve.py in process: concurrent requests, one store context each, streamed tokens that
equal ``dualblade generate``'s."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from dualblade.cli import main  # noqa: E402
from dualblade.models.factory import random_prompts  # noqa: E402
from dualblade.models.kv import MemoryKV  # noqa: E402
from dualblade.models.opt import OptModel  # noqa: E402

pytestmark = pytest.mark.anyio

SERVE = Path(__file__).resolve().parents[2] / "examples" / "serve.py"


@pytest.fixture(scope="module")
def serve() -> ModuleType:
    """examples/serve.py as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("dualblade_example_serve", SERVE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def client(serve: ModuleType, opt_pipeline_toml: Path) -> AsyncIterator[Any]:
    """An HTTP client of the running app (lifespan entered: model loaded, store started)."""
    settings = serve.ServiceSettings(config_path=str(opt_pipeline_toml), policy="dual")
    app = serve.create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
            yield client


def lines(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines()]


async def test_two_concurrent_requests_get_generates_ids(
    client: Any,
    opt_pipeline_toml: Path,
    opt_tiny: OptModel,
    capsys: pytest.CaptureFixture[str],
) -> None:
    explicit = random_prompts(4, 64, 1024, seed=5)
    bodies = {"seed": {"seed": 0}, "explicit": {"prompt_ids": explicit.tolist()}}
    responses: dict[str, Any] = {}

    async def ask(name: str) -> None:
        responses[name] = await client.post("/generate", json=bodies[name])

    async with anyio.create_task_group() as tg:
        for name in bodies:
            tg.start_soon(ask, name)

    # the seed-0 request: what `dualblade generate --seed 0` prints (same model, same prompts),
    # run on a store of its own (the service's holds its direct file)
    own = opt_pipeline_toml.with_name("cli.toml")
    text = opt_pipeline_toml.read_text()
    own.write_text(text.replace("direct.kv", "cli-direct.kv").replace("/pc", "/cli-pc"))
    argv = ["generate", "--preset", "opt-tiny", "--batch", "4", "--prompt-len", "64"]
    argv += ["--gen-len", "8", "--config", str(own), "--device", "cpu", "--json"]
    capsys.readouterr()  # drop whatever the service printed before the CLI runs
    assert await anyio.to_thread.run_sync(main, argv) == 0  # main runs its own event loop
    cli_ids = json.loads(capsys.readouterr().out)["token_ids"]
    seeded = lines(responses["seed"])
    assert seeded[-1]["done"] is True
    assert seeded[-1]["token_ids"] == cli_ids
    # streamed: one line per step, each the step's column of the final ids
    assert [line["step"] for line in seeded[:-1]] == list(range(8))
    assert [line["token_ids"] for line in seeded[:-1]] == [
        list(column) for column in zip(*cli_ids, strict=True)
    ]

    # the explicit prompts: the in-memory reference's tokens
    kv = MemoryKV(layers=4, batch=4, max_len=72, width=64, dtype=torch.float16)
    reference = (await opt_tiny.generate(explicit, 8, kv)).tokens.tolist()
    assert lines(responses["explicit"])[-1]["token_ids"] == reference
    assert reference != cli_ids

    health = (await client.get("/health")).json()
    assert health["served"] == 2
    assert health["active"] == 0
    assert health["peak_active"] == 2  # both requests held a store context at once
    metrics = (await client.get("/metrics")).text
    assert "open_contexts 0" in metrics


async def test_tokens_leave_as_each_step_finishes(
    serve: ModuleType, opt_pipeline_toml: Path
) -> None:
    """At the ASGI level: one body message per decode step, not one body at the end."""
    settings = serve.ServiceSettings(config_path=str(opt_pipeline_toml), gen_len=4)
    app = serve.create_app(settings)
    sent: list[dict[str, Any]] = []
    body = json.dumps({"seed": 1, "gen_len": 3}).encode()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "scheme": "http",
        "server": ("serve", 80),
        "client": ("127.0.0.1", 1),
        "root_path": "",
    }
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    chunks = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    documents = [json.loads(chunk) for chunk in chunks]
    assert [d.get("step") for d in documents] == [0, 1, 2, None]
    assert documents[-1]["done"] is True


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"gen_len": 9}, "at most 72"),
        ({"gen_len": 0}, "gen_len must be in 1..71"),
        ({"prompt_ids": [[1, 2, 3]] * 5}, "batch must be in 1..4"),
        ({"batch": 2, "prompt_len": 70, "gen_len": 3}, "at most 72"),
        ({"prompt_ids": [1, 2, 3]}, "equally long lists"),
        ({"prompt": "hello"}, "unknown fields"),
        ({"prompt_ids": [[5000] * 64] * 4}, "lie in [0, 1024)"),
    ],
)
async def test_bad_requests_get_400(client: Any, body: dict[str, Any], message: str) -> None:
    response = await client.post("/generate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert (await client.get("/health")).json()["active"] == 0


async def test_requests_of_different_sizes_share_one_store(client: Any, opt_tiny: OptModel) -> None:
    """Three requests of other batches and lengths at once, none padded: each gets what the
    in-memory reference generates for it, and the store's ledger is on /metrics."""
    sizes = {"small": (1, 20, 8), "full": (4, 64, 8), "long": (2, 30, 40)}
    prompts = {
        name: random_prompts(b, p, 1024, seed=i)
        for i, (name, (b, p, _)) in enumerate(sizes.items())
    }
    responses: dict[str, Any] = {}

    async def ask(name: str) -> None:
        body = {"prompt_ids": prompts[name].tolist(), "gen_len": sizes[name][2]}
        responses[name] = await client.post("/generate", json=body)

    async with anyio.create_task_group() as tg:
        for name in sizes:
            tg.start_soon(ask, name)
    for name, (batch, prompt_len, gen_len) in sizes.items():
        kv = MemoryKV(
            layers=4, batch=batch, max_len=prompt_len + gen_len, width=64, dtype=torch.float16
        )
        reference = (await opt_tiny.generate(prompts[name], gen_len, kv)).tokens.tolist()
        assert lines(responses[name])[-1]["token_ids"] == reference, name
    metrics = (await client.get("/metrics")).text
    assert "ledger_budget_bytes" in metrics
    assert "ledger_placed_bytes 0" in metrics  # every request gave its share back
