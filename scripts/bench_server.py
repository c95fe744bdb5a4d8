"""The OpenAI server's overhead against calling the engine in-process (docs/benchmarks.md).

For 1 and 32 concurrent streams of the same greedy requests (``ignore_eos``, fixed
``max_tokens``), measure the aggregate output tokens/s and the time to first token:

- in-process: ``async for out in engine.generate(...)`` on an asyncio loop in the
  engine's own process, as a notebook cell does;
- server: ``/v1/completions`` with ``stream: true`` over HTTP from a separate client
  process (httpx), as an application would call it. The client's own cost is off the
  engine's process, as it would be in production.

Rounds alternate the two modes, the order flipped every round (in-process, server;
server, in-process; ...) so that a change in the machine's load hits both; the median
of the rounds is reported. Besides the engine process's CPU per token, each thread's
(the core's, the loop's, the server's: ``pthread_getcpuclockid``) and the client
process's own are printed: the server thread's and the client's are what serving adds.

    .venv/bin/python scripts/bench_server.py --model smollm --rounds 3
    .venv/bin/python scripts/bench_server.py --streams 256 --max-tokens 32 --idle 256
    .venv/bin/python scripts/bench_server.py --shape llama-3.2-1b --streams 1,8

It also reports the time to first token's p99 against its p50 (no stream starved), the
streams that got other than ``max_tokens`` tokens (must be 0), and with ``--idle N`` the
engine process's memory per idle connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = "Once upon a time, in a small village at the edge of a great forest,"


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of the engine's named threads (the server's, the loop's, the
    core's) and of this process as a whole."""
    import threading

    out = {"process": time.process_time()}
    for t in threading.enumerate():
        if t.name in ("nbengine-server", "nbengine-loop", "nbengine-core") and t.ident:
            try:
                out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # the thread ended meanwhile
                pass
    return out


def _cpu_per_token(before: dict[str, float], tokens: float) -> dict[str, float]:
    """Microseconds of CPU per generated token since ``before``, per thread (``cpu_*``)."""
    after = _thread_cpu()
    names = {
        "process": "cpu_us_per_tok",
        "nbengine-server": "cpu_server_us",
        "nbengine-loop": "cpu_loop_us",
        "nbengine-core": "cpu_core_us",
    }
    return {names[k]: (after[k] - before[k]) / tokens * 1e6 for k in before if k in after}


def _summary(
    starts: list[float],
    firsts: list[float],
    ends: list[float],
    tokens: list[int],
    max_tokens: int,
) -> dict[str, float]:
    ttft = sorted(f - s for s, f in zip(starts, firsts))
    wall = max(ends) - min(starts)
    return {
        "tok_s": sum(tokens) / wall,
        "ttft_mean": statistics.mean(ttft),
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "tokens": float(sum(tokens)),
        # Streams that did not get exactly max_tokens tokens (ignore_eos): must be 0.
        "short_streams": float(sum(n != max_tokens for n in tokens)),
        "min_tokens": float(min(tokens)),
    }


async def _in_process(engine: Any, streams: int, max_tokens: int) -> dict[str, float]:
    import nbengine as nb

    params = nb.SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=nb.RequestOutputKind.DELTA,
    )
    starts: list[float] = []
    firsts: list[float] = []
    ends: list[float] = []
    tokens: list[int] = []

    async def one() -> None:
        t0 = time.perf_counter()
        first, n = None, 0
        async for out in engine.generate(PROMPT, params):
            k = len(out.outputs[0].token_ids)
            if k and first is None:
                first = time.perf_counter()
            n += k
        starts.append(t0)
        firsts.append(first if first is not None else time.perf_counter())
        ends.append(time.perf_counter())
        tokens.append(n)

    await asyncio.gather(*(one() for _ in range(streams)))
    return _summary(starts, firsts, ends, tokens, max_tokens)


async def _client(url: str, streams: int, max_tokens: int) -> dict[str, float]:
    import httpx

    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    starts: list[float] = []
    firsts: list[float] = []
    ends: list[float] = []
    tokens: list[int] = []

    async def one(client: Any) -> None:
        t0 = time.perf_counter()
        first, n = None, 0
        async with client.stream("POST", url + "/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                # The first chunk carries the first token (its text may still be empty:
                # the detokenizer holds back an incomplete UTF-8 sequence), as in-process.
                if chunk["choices"] and first is None:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
        starts.append(t0)
        firsts.append(first if first is not None else time.perf_counter())
        ends.append(time.perf_counter())
        tokens.append(n)

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # Open the connections first (an application keeps them open): short requests.
        await asyncio.gather(
            *(
                client.post(url + "/completions", json={"prompt": PROMPT, "max_tokens": 1})
                for _ in range(streams)
            )
        )
        for done in (starts, firsts, ends):
            done.clear()
        tokens.clear()
        c0 = time.process_time()
        await asyncio.gather(*(one(client) for _ in range(streams)))
        client_cpu = time.process_time() - c0
    summary = _summary(starts, firsts, ends, tokens, max_tokens)
    # The client process's own CPU (httpx, parsing each chunk): on a shared machine it
    # competes with the engine's threads, which the in-process consumer does not.
    summary["cpu_client_us"] = client_cpu / max(summary["tokens"], 1.0) * 1e6
    return summary


async def _lean_client(url: str, streams: int, max_tokens: int) -> dict[str, float]:
    """``_client`` without httpx or a JSON parse per chunk: HTTP/1.1 over asyncio streams,
    one read per chunk; only the usage chunk is parsed. It separates what the server
    costs from what a client costs on a machine where both share the cores."""
    from urllib.parse import urlsplit

    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None
    host, port = where.hostname, where.port

    def request(body: dict[str, Any]) -> bytes:
        data = json.dumps(body).encode()
        head = (
            f"POST {where.path}/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        return head.encode() + data

    async def exchange(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes
    ) -> tuple[float, float | None, int]:
        t0 = time.perf_counter()
        writer.write(req)
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b"transfer-encoding: chunked" not in head:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            return t0, None, 0
        first, n = None, 0
        while True:
            size = int(await reader.readline(), 16)
            if size == 0:
                await reader.readline()
                return t0, first, n
            data = await reader.readexactly(size + 2)
            if first is None:  # the first chunk carries the first token, as in _client
                first = time.perf_counter()
            if b'"completion_tokens"' in data:
                for line in data.split(b"\n"):
                    if line.startswith(b"data: {") and b'"completion_tokens"' in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]

    conns = [await asyncio.open_connection(host, port) for _ in range(streams)]
    warm = request({"prompt": PROMPT, "max_tokens": 1})
    await asyncio.gather(*(exchange(r, w, warm) for r, w in conns))
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = request(body)
    c0 = time.process_time()
    results = await asyncio.gather(*(exchange(r, w, req) for r, w in conns))
    client_cpu = time.process_time() - c0
    ends = [time.perf_counter()] * len(results)  # gather ends with the last stream
    for _, w in conns:
        w.close()
    summary = _summary(
        [t0 for t0, _, _ in results],
        [first if first is not None else ends[0] for _, first, _ in results],
        ends,
        [n for _, _, n in results],
        max_tokens,
    )
    summary["cpu_client_us"] = client_cpu / max(summary["tokens"], 1.0) * 1e6
    return summary


def _idle_client(url: str, n: int) -> None:
    """Open ``n`` keep-alive connections (one request each, then idle) and ``n`` more
    that never send a request; say so, and hold them until stdin closes."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None
    socks = []
    for i in range(2 * n):
        s = socket.create_connection((where.hostname, where.port))
        if i < n:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {where.hostname}\r\n\r\n".encode())
            s.recv(65536)
        socks.append(s)
    print("open", flush=True)
    sys.stdin.read()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _idle_round(server: Any, n: int) -> dict[str, float]:
    """The engine process's RSS growth per idle connection, and whether the server let
    them all go (its connection count back to 0) after its idle timeout."""
    import gc

    from nbengine.server.connections import IDLE_TIMEOUT_S

    gc.collect()
    before = _rss()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--idle-client", server.url, "--streams", str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()
    connections = server._uvicorn.server_state.connections
    settle = time.monotonic() + 2.0  # the server's loop accepts the last ones
    while len(connections) < 2 * n and time.monotonic() < settle:
        time.sleep(0.01)
    held = len(connections)
    during = _rss()
    deadline = time.monotonic() + IDLE_TIMEOUT_S * 4
    while server._uvicorn.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.1)
    released = time.monotonic() < deadline
    proc.stdin.close()
    proc.wait()
    return {
        "connections": float(2 * n),
        "held": float(held),
        "rss_per_conn": (during - before) / (2 * n),
        "released": float(released),
    }


def _server_round(url: str, streams: int, max_tokens: int, lean: bool) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--lean-client" if lean else "--client",
            url,
            "--streams",
            str(streams),
            "--max-tokens",
            str(max_tokens),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="smollm",
        help="'smollm' (random weights in SmolLM2-135M's shape), 'default' (the "
        "shipped model), or a model directory",
    )
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's stream_interval (tokens per chunk after the first)",
    )
    ap.add_argument(
        "--shape",
        default=None,
        help="a random model in one of nbengine.bench's shapes (e.g. llama-3.2-1b; "
        "`nbengine bench --shape` builds and caches the same one) instead of --model",
    )
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the most streams")
    ap.add_argument(
        "--idle",
        type=int,
        default=0,
        help="also open N idle keep-alive connections and N that send nothing, and "
        "report the engine process's RSS growth per connection",
    )
    ap.add_argument("--json", default=None, help="also write every round's figures here")
    ap.add_argument(
        "--lean",
        action="store_true",
        help="a client without httpx or a JSON parse per chunk (the server's own cost "
        "with the least client work beside it on the same cores)",
    )
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lean-client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--idle-client", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.idle_client:
        _idle_client(args.idle_client, int(args.streams))
        return
    if args.lean_client:
        run = _lean_client(args.lean_client, int(args.streams), args.max_tokens)
        print(json.dumps(asyncio.run(run)))
        return
    if args.client:
        print(json.dumps(asyncio.run(_client(args.client, int(args.streams), args.max_tokens))))
        return

    import nbengine as nb

    model: str | None
    if args.shape is not None:
        from nbengine.bench import bench_model_dir

        model = str(bench_model_dir(shape=args.shape))
    elif args.model == "smollm":
        from nbengine.bench import bench_model_dir

        model = str(bench_model_dir())
    elif args.model == "default":
        model = None
    else:
        model = args.model
    counts = [int(s) for s in args.streams.split(",")]
    with (
        nb.Engine(model, max_num_seqs=args.max_num_seqs or max(counts)) as engine,
        engine.serve(port=0, stream_interval=args.stream_interval) as server,
    ):
        asyncio.run(_in_process(engine, 2, 8))  # warm-up (native kernels, allocator)
        _server_round(server.url, 2, 8, args.lean)
        rows = []
        for streams in counts:
            local: list[dict[str, float]] = []
            remote: list[dict[str, float]] = []
            for i in range(args.rounds):
                # The order flips every round (A B, B A, ...): neither arm always runs
                # first, after the other's allocations or in a trend of the machine's load.
                for arm in ("local", "remote") if i % 2 == 0 else ("remote", "local"):
                    c0 = _thread_cpu()
                    if arm == "local":
                        r = asyncio.run(_in_process(engine, streams, args.max_tokens))
                    else:
                        r = _server_round(server.url, streams, args.max_tokens, args.lean)
                    r.update(_cpu_per_token(c0, r["tokens"]))
                    (local if arm == "local" else remote).append(r)
            med = {
                k: {m: statistics.median(r[m] for r in runs) for m in runs[0]}
                for k, runs in (("in-process", local), ("server", remote))
            }
            rows.append((streams, med, local, remote))
        idle = _idle_round(server, args.idle) if args.idle else None
    print(
        f"model: {args.shape or args.model}, max_tokens {args.max_tokens}, {args.rounds} rounds, "
        f"stream_interval {args.stream_interval}, {'lean' if args.lean else 'httpx'} client, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        "| streams | in-process tok/s | server tok/s | tok/s overhead | best of rounds | "
        "in-process TTFT p50 | server TTFT p50 | engine-process CPU per token "
        "(in-process / server) | rounds (tok/s in-process / server) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for streams, med, local, remote in rows:
        a, b = med["in-process"], med["server"]
        spread = ", ".join(f"{x['tok_s']:.0f}/{y['tok_s']:.0f}" for x, y in zip(local, remote))
        best_a = max(x["tok_s"] for x in local)
        best_b = max(x["tok_s"] for x in remote)
        print(
            f"| {streams} | {a['tok_s']:.0f} | {b['tok_s']:.0f} | "
            f"{(1 - b['tok_s'] / a['tok_s']) * 100:+.1f}% | "
            f"{best_a:.0f} / {best_b:.0f} ({(1 - best_b / best_a) * 100:+.1f}%) | "
            f"{a['ttft_p50'] * 1000:.0f} ms | {b['ttft_p50'] * 1000:.0f} ms | "
            f"{a['cpu_us_per_tok']:.0f} / {b['cpu_us_per_tok']:.0f} us | {spread} |"
        )
    print()
    print(
        "| streams | TTFT p50 / p99 in-process | TTFT p50 / p99 server | server p99/p50 | "
        "streams short of max_tokens (in-process / server, all rounds) |"
    )
    print("|---|---|---|---|---|")
    for streams, med, local, remote in rows:
        a, b = med["in-process"], med["server"]
        short_a = sum(x["short_streams"] for x in local)
        short_b = sum(x["short_streams"] for x in remote)
        print(
            f"| {streams} | {a['ttft_p50'] * 1000:.0f} / {a['ttft_p99'] * 1000:.0f} ms | "
            f"{b['ttft_p50'] * 1000:.0f} / {b['ttft_p99'] * 1000:.0f} ms | "
            f"{b['ttft_p99'] / b['ttft_p50']:.2f}x | {short_a:.0f} / {short_b:.0f} |"
        )
    print()
    print(
        "| streams | CPU per token, us (median): arm | process | core thread | loop thread | "
        "server thread | client process |"
    )
    print("|---|---|---|---|---|---|---|")
    for streams, med, _, _ in rows:
        for arm in ("in-process", "server"):
            m = med[arm]
            client = f"{m['cpu_client_us']:.0f}" if "cpu_client_us" in m else "-"
            print(
                f"| {streams} | {arm} | {m['cpu_us_per_tok']:.0f} | "
                f"{m.get('cpu_core_us', 0):.0f} | {m.get('cpu_loop_us', 0):.0f} | "
                f"{m.get('cpu_server_us', 0):.0f} | {client} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "argv": sys.argv[1:],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load": open("/proc/loadavg").read().split()[:3],
                    "rows": [
                        {"streams": st, "median": med, "in_process": lo, "server": re}
                        for st, med, lo, re in rows
                    ],
                    "idle": idle,
                },
                f,
                indent=1,
            )
    if idle is not None:
        print()
        print(
            f"idle: {idle['connections']:.0f} connections ({args.idle} keep-alive after a "
            f"request, {args.idle} never sending one), {idle['held']:.0f} held by the server, "
            f"engine-process RSS +{idle['rss_per_conn'] / 1024:.1f} KiB per connection, "
            f"all released after the idle timeout: {bool(idle['released'])}"
        )


if __name__ == "__main__":
    main()
