"""Traces of a small run (a track per actor kind, slices, counters) and Prometheus metrics."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from dualblade.bench.kv_workload import run_kv_workload
from dualblade.store import open_store
from dualblade.telemetry import Metrics, Tracer

pytestmark = pytest.mark.anyio

ACTOR_KINDS = ["budgeter", "binder", "copy-thread-", "gpu-dma", "strategy-probe"]


def events_by_kind(document: dict) -> dict[str, list[dict]]:
    """Non-metadata events per actor kind, by their track's name."""
    names = {
        e["tid"]: e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    out: dict[str, list[dict]] = {kind: [] for kind in ACTOR_KINDS}
    for event in document["traceEvents"]:
        if event["ph"] == "M" or event["tid"] not in names:
            continue
        for kind in ACTOR_KINDS:
            if names[event["tid"]].startswith(kind):
                out[kind].append(event)
    return out


async def test_trace_has_every_actor_kind(make_config, tmp_path):
    config = make_config("dual", prompt_len=16, max_new_tokens=4)
    tracer = Tracer()
    async with open_store(config, device="cpu", tracer=tracer) as store:
        result = await run_kv_workload(store)
    assert result.verified_bytes > 0
    path = tmp_path / "trace" / "t.json"
    tracer.write(path)
    document = json.loads(path.read_text())  # valid JSON
    assert isinstance(document["traceEvents"], list)
    tracks = tracer.tracks()
    for kind in ACTOR_KINDS:
        assert any(t.startswith(kind) for t in tracks), f"no {kind} track in {tracks}"
    by_kind = events_by_kind(document)
    for kind, events in by_kind.items():
        assert events, f"no events on the {kind} track"
    for kind in ["binder", "copy-thread-", "gpu-dma"]:
        slices = [e for e in by_kind[kind] if e["ph"] == "X"]
        assert slices, f"no slices on {kind}"
        for event in slices:
            assert isinstance(event["ts"], (int, float))
            assert isinstance(event["dur"], (int, float))
            assert event["dur"] >= 0
    assert any(e["dur"] > 0 for e in by_kind["copy-thread-"] if e["ph"] == "X")
    assert any(e["name"].startswith("h2d") for e in by_kind["gpu-dma"])
    assert any(e["name"] == "claim extent" for e in by_kind["binder"])
    assert any(e["name"] == "trim" for e in by_kind["binder"])
    assert any(e["name"] == "locked" for e in by_kind["strategy-probe"])
    counters = {e["name"] for e in document["traceEvents"] if e["ph"] == "C"}
    assert {"budget", "probe throughput"} <= counters
    for event in document["traceEvents"]:
        if event["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in event["args"].values())


async def test_disabled_tracer_records_nothing(make_config):
    tracer = Tracer(enabled=False)
    async with open_store(make_config("direct"), device="cpu", tracer=tracer) as store:
        await run_kv_workload(store, decode_steps=1)
    assert tracer.document()["traceEvents"] == []


def test_trace_time_base_is_a_monotonic_reading():
    """An event's ``ts`` plus the document's ``monotonic_t0_s`` is the CLOCK_MONOTONIC time it
    was recorded at, so samples taken outside the process line up with the trace."""
    tracer = Tracer()
    before = time.monotonic()
    tracer.instant("probe", "mark")
    after = time.monotonic()
    document = tracer.document()
    (mark,) = [e for e in document["traceEvents"] if e.get("name") == "mark"]
    at = document["otherData"]["monotonic_t0_s"] + mark["ts"] / 1e6
    assert before <= at <= after


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)$")
TYPE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)$")
HELP = re.compile(r"^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+$")


def parse_prometheus(text: str) -> dict[str, tuple[str, float]]:
    """Name -> (kind, value); asserts every line is well-formed and typed before its sample."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if match := TYPE.match(line):
            assert match[1] not in types, f"TYPE twice for {match[1]}"
            types[match[1]] = match[2]
        elif HELP.match(line):
            continue
        else:
            match = SAMPLE.match(line)
            assert match, f"not a Prometheus line: {line!r}"
            name, value = match[1], float(match[2])
            assert name in types, f"{name} has no TYPE line before it"
            assert math.isfinite(value)
            samples[name] = (types[name], value)
    assert set(samples) == set(types)
    return samples


async def test_prometheus_text_parses_and_matches_metrics(make_config):
    config = make_config("dual", prompt_len=300, max_new_tokens=2)
    async with open_store(config, device="cpu") as store:
        await run_kv_workload(store)
        text = store.prometheus()
        metrics = store.metrics()
    samples = parse_prometheus(text)
    assert samples["dualblade_page_cache_budget_bytes"] == ("gauge", 2 << 20)
    assert samples["dualblade_open_contexts"] == ("gauge", 0)
    for path, value in metrics["read_bytes"].items():
        name = f"dualblade_read_bytes_{path.replace('-', '_')}"
        assert samples[name] == ("gauge", value), f"{name} lost precision"
    for path, value in metrics["write_bytes"].items():
        assert samples[f"dualblade_write_bytes_{path.replace('-', '_')}"][1] == value
    assert 0 <= samples["dualblade_page_cache_hit_rate"][1] <= 1


def test_metrics_counters_and_exact_values():
    metrics = Metrics(prefix="app")
    metrics.inc("requests", help="requests served")
    metrics.inc("requests", 2)
    metrics.inc("bytes_total", 1234567891)
    metrics.set("ratio", 0.125)
    metrics.set("big", 2**53)
    assert metrics.get("requests") == 3
    assert metrics.get("missing") == 0
    assert metrics.snapshot() == {
        "requests": 3,
        "bytes_total": 1234567891,
        "ratio": 0.125,
        "big": 2**53,
    }
    samples = parse_prometheus(metrics.prometheus())
    assert samples == {
        "app_requests_total": ("counter", 3),
        "app_bytes_total": ("counter", 1234567891),
        "app_ratio": ("gauge", 0.125),
        "app_big": ("gauge", 2**53),
    }
    assert "# HELP app_requests_total requests served" in metrics.prometheus()
