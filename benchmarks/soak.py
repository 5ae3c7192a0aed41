"""A soak of the OpenAI server: many mixed requests, clients that go away, nothing leaked.

Every request draws (seeded) its endpoint (completions or chat), streaming, ``n``, logprobs,
structured output (a JSON schema or a regex) and length; a share of the clients disconnect in
the middle of their stream, another share give up while their request still waits (the
concurrency is above the engine's slots, so requests queue). Afterwards the engine must be idle
and clean (``GET /debug/engine``: nothing running or waiting, every KV page free or held by
the prefix cache, every slot free, invariants checked), every sequence submitted must have one
finish reason in ``/metrics`` (submitted = stop + length + abort + error) with no error, and
the server's RSS must be within 5 % of its level after the first 1,000 requests.

    python benchmarks/soak.py --tiny-model /tmp/soak-tiny --requests 10000 \
        --context-length 128 --max-running-requests 16

``--tiny-model DIR`` writes (if absent) and serves the test suite's tiny Llama: random weights,
a byte-fallback tokenizer of 301 tokens and a chat template (tests/tiny_server.py); other
flags go to ``serve`` (``--model`` for another model: SmolLM2's 49k vocabulary samples at
about 20 tokens/s on a 2-core CPU, too slow for 10,000 requests). It starts ``minijax-serve
serve`` (``--enable-debug-endpoints``) unless given ``--base-url`` (and ``--pid`` for the RSS).
tests/server/test_server_soak.py runs :func:`drive` and :func:`check` for a few hundred requests
against the tiny test server. The RSS is read with psutil (a dependency of orbax-checkpoint, so
always installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import httpx

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
REGEX = "[a-z]{2,6}"
WORDS = "the cat sat on a mat while dogs ran far away from home to see birds".split()


class Plan(NamedTuple):
    path: str
    body: dict[str, Any]
    fate: str  # "full", "disconnect" (mid-stream) or "abort" (while waiting)


def plan(rng: random.Random, disconnect: float = 0.2, abort: float = 0.05) -> Plan:
    """One request of the mix."""
    fate = rng.choices(("disconnect", "abort", "full"),
                       (disconnect, abort, 1 - disconnect - abort))[0]
    chat = rng.random() < 0.4
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 24), "n": rng.choice((1, 1, 1, 2, 3)),
                            "temperature": rng.choice((0, 0.7)), "seed": rng.randrange(2**31),
                            "stream": fate == "disconnect" or rng.random() < 0.4}
    if rng.random() < 0.3:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if rng.random() < 0.1:
        if rng.random() < 0.5:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": SCHEMA}}
        else:
            body["regex"] = REGEX
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return Plan("/v1/chat/completions" if chat else "/v1/completions", body, fate)


def _check_output(body: dict[str, Any], choices: dict[int, dict[str, Any]]) -> str | None:
    """What is wrong with a finished answer's choices (None if nothing)."""
    if len(choices) != body["n"]:
        return f"{len(choices)} choices for n={body['n']}"
    for c in choices.values():
        if c["finish"] not in ("stop", "length"):
            return f"finish_reason {c['finish']}"
        if c["finish"] == "stop" and "regex" in body and not re.fullmatch(REGEX, c["text"]):
            return f"{c['text']!r} does not match {REGEX}"
        if c["finish"] == "stop" and "response_format" in body:
            value = json.loads(c["text"])
            if not isinstance(value.get("a"), int):
                return f"{c['text']!r} does not fit the schema"
    return None


async def one(http: httpx.AsyncClient, p: Plan, rng: random.Random) -> tuple[str, str | None]:
    """Run one planned request: (its outcome, a problem or None)."""
    chat = p.path.endswith("chat/completions")
    if p.fate == "abort":  # gives up within a few ms: still tokenizing or queued
        try:
            res = await asyncio.wait_for(http.post(p.path, json=p.body), rng.uniform(0.001, 0.02))
        except asyncio.TimeoutError:
            return "aborted", None
        return "ok", None if res.status_code == 200 else f"{res.status_code} {res.text[:200]}"
    choices: dict[int, dict[str, Any]] = {}
    if not p.body["stream"]:
        res = await http.post(p.path, json=p.body)
        if res.status_code != 200:
            return "failed", f"{res.status_code} {res.text[:200]}"
        for c in res.json()["choices"]:
            text = c["message"]["content"] if chat else c["text"]
            choices[c["index"]] = {"text": text, "finish": c["finish_reason"]}
        return "ok", _check_output(p.body, choices)
    keep = rng.randint(1, 3) if p.fate == "disconnect" else None  # events read before leaving
    async with http.stream("POST", p.path, json=p.body) as res:
        if res.status_code != 200:
            return "failed", f"{res.status_code} {(await res.aread())[:200]!r}"
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "failed", str(event["error"])
            for c in event["choices"]:
                got = choices.setdefault(c["index"], {"text": "", "finish": None})
                got["text"] += (c["delta"].get("content") or "") if chat else c["text"]
                got["finish"] = c["finish_reason"] or got["finish"]
            if keep is not None:
                keep -= 1
                if keep == 0:
                    return "disconnected", None
    return "ok", _check_output(p.body, choices)


async def drive(base_url: str, count: int, concurrency: int, seed: int = 0,
                on_done: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``count`` planned requests, ``concurrency`` at a time; the outcomes counted and the
    first problems listed. ``on_done(i)`` after each request finishes."""
    rng, outcomes, problems = random.Random(seed), {}, []
    plans = [plan(rng) for _ in range(count)]
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(plans):
        queue.put_nowait((i, p))
    done = 0
    # idle connections dropped before the server's 5 s keep-alive ends them (else a request
    # sent on one as it closes is reset: the client's race, not the server's)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        async def worker(wid: int) -> None:
            nonlocal done
            wrng = random.Random(seed * 1000 + wid)
            while not queue.empty():
                i, p = queue.get_nowait()
                try:
                    outcome, problem = await one(http, p, wrng)
                except Exception as e:  # the server must not make a client fail
                    outcome, problem = "failed", f"{type(e).__name__}: {e}"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if problem is not None and len(problems) < 20:
                    problems.append(f"request {i} ({p.path}, {p.fate}): {problem}")
                done += 1
                if on_done is not None:
                    on_done(done)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return {"outcomes": outcomes, "problems": problems}


def counters(metrics: str) -> dict[str, float]:
    """Sequences submitted, and finished by reason, from /metrics."""
    out = {"submitted": 0.0}
    for line in metrics.splitlines():
        if line.startswith("minijax_requests_total{"):
            out[line.split('"')[1]] = float(line.split()[1])
        elif line.startswith("minijax_requests_submitted_total "):
            out["submitted"] = float(line.split()[1])
    return out


def check(report: dict[str, Any], metrics: str, errors_before: float = 0) -> list[str]:
    """What is wrong once the soak is over: the engine's report (``GET /debug/engine``) not
    idle and clean, or the counters not adding up (or errors among them, past
    ``errors_before``)."""
    wrong = [f"engine: {key}={report[key]}" for key in ("running", "waiting", "unfinished")
             if report[key]]
    if not report["idle"] or report["invariants"] != "ok":
        wrong.append(f"engine not idle and clean: {report}")
    c = counters(metrics)
    finished = sum(v for k, v in c.items() if k != "submitted")
    if c["submitted"] != finished:
        wrong.append(f"submitted {c['submitted']} != finished {finished} ({c})")
    if c.get("error", 0) > errors_before:
        wrong.append(f"{c['error'] - errors_before} sequences ended in an engine error")
    return wrong


def wait_idle(base_url: str, timeout: float = 120) -> dict[str, Any]:
    """``GET /debug/engine`` once nothing runs or waits (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        report = httpx.get(base_url + "/debug/engine", timeout=60).json()
        if not report["unfinished"] or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", default=None, help="a running server (else one is started)")
    parser.add_argument("--pid", type=int, default=None, help="its process, for the RSS")
    parser.add_argument("--port", type=int, default=30047)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--tiny-model", type=Path, default=None, metavar="DIR",
                        help="serve the test suite's tiny Llama, written to DIR if absent")
    args, serve_flags = parser.parse_known_args()  # the rest: serve's flags
    if args.tiny_model is not None:
        serve_flags += ["--model", str(make_tiny_model(args.tiny_model))]
    proc = None
    if args.base_url is None:
        args.base_url = f"http://127.0.0.1:{args.port}"
        proc = subprocess.Popen([sys.executable, "-m", "minijax_serve", "serve", "--port",
                                 str(args.port), "--enable-debug-endpoints", "--log-level",
                                 "warning", *serve_flags])
        args.pid = proc.pid
        _wait_healthy(args.base_url, proc)
    try:
        return _soak(args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def make_tiny_model(path: Path) -> Path:
    """The tiny Llama of tests/tiny_server.py in ``path`` (written once)."""
    if not (path / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.hf_reference import save_tiny_model
        from tests.frontend.test_detokenizer import byte_fallback_tokenizer
        from tests.tiny_server import TEMPLATE

        save_tiny_model("llama", path)
        tokenizer = byte_fallback_tokenizer()
        tokenizer.chat_template = TEMPLATE
        tokenizer.save_pretrained(path)
    return path


def _wait_healthy(base_url: str, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server exited with {proc.returncode}")


def _soak(args: argparse.Namespace) -> int:
    import psutil

    server = psutil.Process(args.pid) if args.pid else None
    rss: dict[int, float] = {}
    start = time.monotonic()

    def on_done(done: int) -> None:
        if server is not None and done % 1000 == 0:
            rss[done] = server.memory_info().rss / 2**20
            print(f"{done} requests, {time.monotonic() - start:.0f} s, RSS {rss[done]:.1f} MiB",
                  flush=True)

    result = asyncio.run(drive(args.base_url, args.requests, args.concurrency, args.seed, on_done))
    elapsed = time.monotonic() - start
    report = wait_idle(args.base_url)
    metrics = httpx.get(args.base_url + "/metrics").text
    wrong = check(report, metrics) + result["problems"]
    if result["outcomes"].get("failed"):
        wrong.append(f"{result['outcomes']['failed']} requests failed")
    if server is not None:
        rss["end"] = server.memory_info().rss / 2**20
        if 1000 in rss and abs(rss["end"] - rss[1000]) > 0.05 * rss[1000]:
            wrong.append(f"RSS {rss['end']:.1f} MiB at the end, {rss[1000]:.1f} after 1,000")
    summary = {"requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
               "elapsed_s": round(elapsed, 1), "outcomes": result["outcomes"],
               "counters": counters(metrics), "engine": report, "rss_mib": rss, "wrong": wrong}
    print(json.dumps(summary, indent=1))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(summary, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
