"""A generation service on dualblade: concurrent requests, one KV-store context each, tokens
streamed as they are decoded.

Run it (``pip install -e '.[serve]'``)::

    python examples/serve.py --preset opt-tiny --batch 4 --prompt-len 64 --gen-len 8 --port 8000
    curl -N localhost:8000/generate -d '{"seed": 0}'
    curl -N localhost:8000/generate -d '{"prompt_ids": [[2, 100, ...], ...], "gen_len": 4}'

Every response line is one JSON document (newline-delimited JSON): a ``{"step": i,
"token_ids": [...]}`` per decode step, one id per sequence, as soon as the step is done, then
``{"done": true, "token_ids": [[...], ...], "prefill_s": ..., "decode_s": ...}``.

One store serves the whole process (its actors, copy threads and pinned buffers are set up
once, in the app's lifespan); each request gets its own context — its own extent on the direct
target and its own page-cache files — released when the request ends, also when the client
goes away mid-stream. All contexts share the store's one page-cache budget (its ledger, on
``/metrics``): a new request gets its fair share, moved to it from the others' layers while they
decode, and a finished one gives its share back. Each request has its own shape: any batch up
to ``--batch`` and any prompt with prompt + ``gen_len`` up to ``--prompt-len`` + ``--gen-len``
rows (the store's workload, which sizes its copy buffers), with nothing padded.
A request with ``{"seed": s}`` gets the prompts ``dualblade generate --seed s`` draws
(``"batch"`` and ``"prompt_len"`` choose their size); with the service's weight seed equal to
``s`` too (``--seed s``), it gets that command's very tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dualblade.commands import load_run_config
from dualblade.errors import ConfigError
from dualblade.models import (
    KVProvider,
    OptModel,
    build_model,
    open_kv,
    random_prompts,
    store_config,
)


@dataclass
class ServiceSettings:
    """What one service process runs: the model, the store's workload shape and its policy."""

    preset: str | None = "opt-tiny"
    model_path: str | None = None
    config_path: str | None = None
    policy: str = "dual"
    device: str = "cpu"
    batch: int = 4
    prompt_len: int = 64
    gen_len: int = 8
    seed: int = 0
    memory_limit: int | None = None


@dataclass
class _Live:
    """What the lifespan set up, and how busy the service is."""

    model: OptModel
    kv: KVProvider
    settings: ServiceSettings
    active: int = 0
    peak_active: int = 0
    served: int = 0


def create_app(settings: ServiceSettings) -> Starlette:
    """The ASGI app; the model loads and the store starts in its lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        model = build_model(
            preset=settings.preset,
            model_path=settings.model_path,
            seed=settings.seed,
            device=settings.device,
        )
        config = store_config(
            load_run_config(settings.config_path, None),
            model.arch,
            batch=settings.batch,
            prompt_len=settings.prompt_len,
            gen_len=settings.gen_len,
            policy=settings.policy,
        )
        async with open_kv(
            config, settings.policy, device=settings.device, memory_limit=settings.memory_limit
        ) as kv:
            app.state.live = _Live(model, kv, settings)
            yield

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", metrics),
        ],
        lifespan=lifespan,
    )


async def generate(request: Request) -> Response:
    """Stream one request's tokens as newline-delimited JSON (400 for a bad request body)."""
    live: _Live = request.app.state.live
    try:
        body = json.loads(await request.body() or b"{}")
        prompts, gen_len = _parse(body, live)
        live.model.check_request(prompts, gen_len)
    except (ValueError, TypeError, ConfigError) as error:
        return JSONResponse({"error": str(error)}, status_code=400)
    return StreamingResponse(_stream(live, prompts, gen_len), media_type="application/x-ndjson")


async def _stream(live: _Live, prompts: torch.Tensor, gen_len: int) -> AsyncIterator[bytes]:
    live.active += 1
    live.peak_active = max(live.peak_active, live.active)
    steps: list[list[int]] = []
    times: list[float] = []
    start = time.perf_counter()
    try:
        request = live.model.stream(prompts, gen_len, live.kv, fit=True)
        async with contextlib.aclosing(request) as tokens:
            async for token in tokens:
                now = time.perf_counter()
                times.append(now - start)
                start = now
                steps.append(token.tolist())
                yield _line({"step": len(steps) - 1, "token_ids": steps[-1]})
        per_sequence = [list(ids) for ids in zip(*steps, strict=True)]
        yield _line(
            {
                "done": True,
                "token_ids": per_sequence,
                "prefill_s": round(times[0], 6),
                "decode_s": round(sum(times[1:]), 6),
            }
        )
        live.served += 1
    finally:
        live.active -= 1


def _parse(body: Any, live: _Live) -> tuple[torch.Tensor, int]:
    """The request's prompts (``prompt_ids`` or ``seed``) and ``gen_len``."""
    settings = live.settings
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    unknown = set(body) - {"prompt_ids", "seed", "gen_len", "batch", "prompt_len"}
    if unknown:
        raise ValueError(
            f"unknown fields {sorted(unknown)}; use prompt_ids, or seed with batch and "
            "prompt_len, and gen_len"
        )
    gen_len = int(body.get("gen_len", settings.gen_len))
    rows = settings.prompt_len + settings.gen_len
    if not 1 <= gen_len < rows:
        raise ValueError(f"gen_len must be in 1..{rows - 1}")
    if "prompt_ids" in body:
        prompts = torch.tensor(body["prompt_ids"], dtype=torch.int64)
        if prompts.dim() != 2:
            raise ValueError("prompt_ids must be a list of equally long lists of token ids")
        batch, prompt_len = prompts.shape
    else:
        batch = int(body.get("batch", settings.batch))
        prompt_len = int(body.get("prompt_len", settings.prompt_len))
        seed = int(body.get("seed", settings.seed))
        prompts = torch.empty(0)
    if not 1 <= batch <= settings.batch:
        raise ValueError(f"a request's batch must be in 1..{settings.batch}")
    if prompt_len < 1 or prompt_len + gen_len > rows:
        raise ValueError(f"prompt length + gen_len must be at most {rows} (and the prompt >= 1)")
    if "prompt_ids" in body:
        return prompts, gen_len
    return random_prompts(batch, prompt_len, live.model.arch.vocab_size, seed), gen_len


def _line(document: dict[str, Any]) -> bytes:
    return (json.dumps(document) + "\n").encode()


async def health(request: Request) -> Response:
    """Liveness, and how many requests are running and have run."""
    live: _Live = request.app.state.live
    return JSONResponse(
        {
            "model": live.model.arch.name,
            "policy": live.settings.policy,
            "active": live.active,
            "peak_active": live.peak_active,
            "served": live.served,
        }
    )


async def metrics(request: Request) -> Response:
    """The store's metrics in the Prometheus text format (a JSON snapshot for ``memory``)."""
    kv = request.app.state.live.kv
    prometheus = getattr(kv, "prometheus", None)
    if prometheus is None:
        return JSONResponse(kv.metrics())
    return PlainTextResponse(prometheus())


def main() -> None:
    import uvicorn

    from dualblade.pipeline import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--preset", default="opt-tiny")
    parser.add_argument("--model", help="local checkpoint folder instead of a preset")
    parser.add_argument("--config", help="pipeline config (TOML/YAML); default: embedded")
    parser.add_argument(
        "--policy",
        default="dual",
        choices=("dual", "direct", "page-cache", "cache-policy", "baseline", "memory"),
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=8, help="the most a request may ask for")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--memory-limit", help="plan against this memory limit, e.g. 2GiB")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    settings = ServiceSettings(
        preset=None if args.model else args.preset,
        model_path=args.model,
        config_path=args.config,
        policy=args.policy,
        device=args.device,
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        seed=args.seed,
        memory_limit=parse_size(args.memory_limit) if args.memory_limit else None,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
