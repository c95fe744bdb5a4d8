"""The ``nbengine`` command: ``demo``, ``generate``, ``bench``, ``install-kernel``."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

DEMO_PROMPTS: dict[str, str] = {
    "for-loop": "The for statement",
    "lists": "A list is",
    "imports": "The import system",
    "dicts": "A dictionary",
    "errors": "An exception is raised when",
}
CANCEL_ID = "imports"  # the demo cancels this one mid-stream, then reuses its id


@dataclass(slots=True)
class _Track:
    """What the demo's terminal view knows about one request."""

    request_id: str
    prompt: str
    start: float
    status: str = "QUEUED"
    text: str = ""
    num_tokens: int = 0
    first_token_at: float | None = None
    end: float | None = None
    finish_reason: str | None = None
    attempt: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def label(self) -> str:
        """The request id, marked when it is a reuse of a cancelled request's id."""
        return self.request_id if self.attempt == 1 else f"{self.request_id}#{self.attempt}"


def _consume(handle: object, track: _Track) -> None:
    """Stream one handle (sync iteration on its own thread) into ``track``."""
    for out in handle:  # type: ignore[attr-defined]
        comp = out.outputs[0]
        with track.lock:
            if comp.token_ids and track.first_token_at is None:
                track.first_token_at = time.monotonic()
            track.text = comp.text
            track.num_tokens = len(comp.token_ids)
            track.status = out.status.name
            if out.finished:
                track.end = time.monotonic()
                track.finish_reason = comp.finish_reason


def _status_lines(tracks: Sequence[_Track], width: int) -> list[str]:
    lines = []
    for t in tracks:
        with t.lock:
            snippet = " ".join(t.text.split())
            head = f"{t.label:<11} {t.status:<22} {t.num_tokens:>4} tok  "
            lines.append((head + snippet[-max(10, width - len(head)):])[:width])
    return lines


def _render(out: TextIO, tracks: Sequence[_Track], previous: int) -> int:
    """Redraw the status block in place on a terminal; returns the lines drawn."""
    lines = _status_lines(tracks, width=100)
    if previous:
        out.write(f"\x1b[{previous}F")
    for line in lines:
        out.write("\x1b[2K" + line + "\n")
    out.flush()
    return len(lines)


def run_demo(model: str | None = None, max_tokens: int = 48, out: TextIO = sys.stdout) -> int:
    """Stream several prompts at once, cancel one through the confirmed abort, reuse its id."""
    import nbengine as nb

    live = out.isatty()
    out.write("Loading the model... ")
    out.flush()
    t0 = time.monotonic()
    with nb.Engine(model) as engine:
        out.write(f"ready in {time.monotonic() - t0:.1f}s\n\n")
        params = nb.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        tracks: list[_Track] = []
        threads: list[threading.Thread] = []

        def start(request_id: str, prompt: str, sp: nb.SamplingParams, attempt: int) -> _Track:
            track = _Track(request_id, prompt, time.monotonic(), attempt=attempt)
            handle = engine.generate(prompt, sp, request_id=request_id)
            thread = threading.Thread(target=_consume, args=(handle, track), daemon=True)
            thread.start()
            tracks.append(track)
            threads.append(thread)
            return track

        for rid, prompt in DEMO_PROMPTS.items():
            start(rid, prompt, params, attempt=1)
        # Let the one we cancel produce some text, then abort it through the protocol:
        # engine.abort() returns only once the core has freed the request.
        victim = next(t for t in tracks if t.request_id == CANCEL_ID)
        drawn = 0
        while True:
            with victim.lock:
                if victim.num_tokens >= 8 or victim.end is not None:
                    break
            if live:
                drawn = _render(out, tracks, drawn)
            time.sleep(0.05)
        t_abort = time.monotonic()
        engine.abort(CANCEL_ID)
        abort_ms = (time.monotonic() - t_abort) * 1000
        # The id is free the moment abort() returns.
        start(CANCEL_ID, "Cancelled requests", params, attempt=2)
        while any(t.is_alive() for t in threads):
            if live:
                drawn = _render(out, tracks, drawn)
            time.sleep(0.1)
        if live:
            _render(out, tracks, drawn)
        else:
            for line in _status_lines(tracks, width=100):
                out.write(line + "\n")

    out.write(
        f"\nCancelled {CANCEL_ID!r}: abort() returned after {abort_ms:.1f} ms, once the core "
        "had confirmed the release; the id was reused at once.\n\n"
    )
    out.write(f"{'request':<12}{'finish':<8}{'tokens':>7}{'TTFT ms':>10}{'tok/s':>8}  text\n")
    for t in tracks:
        ttft = (t.first_token_at - t.start) * 1000 if t.first_token_at else float("nan")
        dur = (t.end or time.monotonic()) - (t.first_token_at or t.start)
        rate = (t.num_tokens - 1) / dur if t.num_tokens > 1 and dur > 0 else float("nan")
        text = " ".join((t.prompt + t.text).split())[:80]
        out.write(
            f"{t.label:<12}{t.finish_reason or '-':<8}{t.num_tokens:>7}{ttft:>10.1f}{rate:>8.1f}  "
            f"{text}\n"
        )
    return 0


def run_generate(prompt: str, model: str | None, max_tokens: int, temperature: float,
                 seed: int | None, out: TextIO = sys.stdout) -> int:
    """Stream one completion to ``out``."""
    import nbengine as nb

    with nb.Engine(model) as engine:
        params = nb.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed,
            output_kind=nb.RequestOutputKind.DELTA,
        )
        out.write(prompt)
        for chunk in engine.generate(prompt, params):
            out.write(chunk.outputs[0].text)
            out.flush()
        out.write("\n")
    return 0


def run_bench_cli(args: argparse.Namespace) -> int:
    """``nbengine bench``: run, print the table, optionally write the JSON report."""
    import json

    from nbengine.bench import BenchConfig, format_report, run_bench

    config = BenchConfig(
        model_dir=args.model,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        engines=tuple(e.strip() for e in args.engines.split(",") if e.strip()),
        dtype=args.dtype,
        scale=0.1 if args.quick else args.scale,
        repeats=args.repeats,
        abort_latency=not args.no_abort,
        threads=args.threads,
        omp_wait_policy=args.omp_wait_policy,
    )
    report = run_bench(config, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nbengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="stream several prompts, cancel one, reuse its id")
    demo.add_argument("--model", default=None, help="Hugging Face model directory")
    demo.add_argument("--max-tokens", type=int, default=48)

    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)

    bench = sub.add_parser("bench", help="throughput/latency against transformers (see docs/benchmarks.md)")
    bench.add_argument("--model", default=None,
                       help="model directory (default: random weights in SmolLM2-135M's shape)")
    bench.add_argument("--workloads", default="W1,W2,W3", help="comma-separated: W1,W2,W3")
    bench.add_argument("--engines", default="nbengine,hf_static,hf_cb",
                       help="comma-separated: nbengine,hf_static,hf_cb")
    bench.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    bench.add_argument("--scale", type=float, default=1.0, help="shrink workloads (e.g. 0.1)")
    bench.add_argument("--quick", action="store_true", help="same as --scale 0.1")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads for every engine (default: physical cores)")
    bench.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE"),
                       help="OMP_WAIT_POLICY of every engine's process (default: PASSIVE, "
                            "what import nbengine sets)")
    bench.add_argument("--no-abort", action="store_true", help="skip the abort() latency check")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the report here")

    kern = sub.add_parser("install-kernel", help="install the 'nbengine' Jupyter kernelspec")
    where = kern.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the user's Jupyter data dir")
    where.add_argument("--sys-prefix", action="store_true", help="into this environment (default)")

    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args.model, args.max_tokens)
    if args.command == "generate":
        return run_generate(args.prompt, args.model, args.max_tokens, args.temperature, args.seed)
    if args.command == "bench":
        return run_bench_cli(args)
    if args.command == "install-kernel":
        from nbengine.kernelspec import install_kernel

        path = install_kernel(user=args.user, sys_prefix=args.sys_prefix)
        print(f"Installed kernelspec 'nbengine' in {path}")
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
