"""The ``nbengine`` command: ``demo``, ``generate``, ``bench``, ``serve``, ``tutorials``,
``install-kernel``.

A bad value (``--max-tokens 0``, a missing model directory, an empty prompt, ...) prints
one line, ``nbengine: error: ...``, and exits with status 2, as argparse does for a
bad option; ``--debug`` shows the traceback instead. So does a command whose optional
dependencies are missing (``serve`` without the serve extra, ``bench`` without
transformers): it is checked before any work, and the line names the extra to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TextIO

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


ELLIPSIS = "..."


def _head_words(text: str, width: int) -> str:
    """The start of ``text`` (whitespace collapsed) in at most ``width`` characters, cut
    after a whole word and marked with an ellipsis where it was cut."""
    return textwrap.shorten(text, width, placeholder=" " + ELLIPSIS)


def _tail_words(text: str, width: int) -> str:
    """The end of ``text`` (whitespace collapsed) in at most ``width`` characters, from the
    start of a whole word and marked with a leading ellipsis where it was cut. Only a
    single word wider than ``width`` is cut inside the word."""
    words = text.split()
    whole = " ".join(words)
    if len(whole) <= width:
        return whole
    budget = width - len(ELLIPSIS) - 1
    kept: list[str] = []
    used = -1  # no space before the first word kept
    for word in reversed(words):
        if used + 1 + len(word) > budget:
            break
        kept.append(word)
        used += 1 + len(word)
    if not kept:  # the last word alone is wider than the line
        return whole[-width:]
    return ELLIPSIS + " " + " ".join(reversed(kept))


def _status_lines(tracks: Sequence[_Track], width: int) -> list[str]:
    """The demo's live view: one line per request, its id, status, tokens and the end of
    its text (whole words), at most ``width`` characters."""
    lines = []
    for t in tracks:
        with t.lock:
            head = f"{t.label:<11} {t.status:<22} {t.num_tokens:>4} tok  "
            lines.append(head + _tail_words(t.text, max(10, width - len(head))))
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
    try:
        engine = nb.Engine(model)
    except BaseException:
        out.write("failed.\n")  # end the line; the error follows on stderr
        out.flush()
        raise
    with engine:
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

        # The one we cancel may write at length (the shipped model decodes about a thousand
        # tokens a second, so with the others' budget it could finish before the abort).
        long_params = nb.SamplingParams(temperature=0.0, max_tokens=8 * max_tokens)
        for rid, prompt in DEMO_PROMPTS.items():
            start(rid, prompt, long_params if rid == CANCEL_ID else params, attempt=1)
        # Let the one we cancel produce some text, then abort it through the protocol:
        # engine.abort() returns only once the core has freed the request.
        victim = next(t for t in tracks if t.request_id == CANCEL_ID)
        drawn = 0
        last_drawn = 0.0
        while True:
            with victim.lock:
                if victim.num_tokens >= 8 or victim.end is not None:
                    break
            if live and time.monotonic() - last_drawn >= 0.05:
                drawn = _render(out, tracks, drawn)
                last_drawn = time.monotonic()
            time.sleep(0.002)
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

    if victim.finish_reason == "abort":
        out.write(
            f"\nCancelled {CANCEL_ID!r} after {victim.num_tokens} tokens: abort() returned after "
            f"{abort_ms:.1f} ms, once the core had confirmed the release; the id was reused "
            "at once.\n\n"
        )
    else:  # it ended on its own first: abort() of a finished request returns at once
        out.write(
            f"\n{CANCEL_ID!r} finished ({victim.finish_reason}) before the abort reached it; "
            f"abort() returned after {abort_ms:.1f} ms and the id was reused at once.\n\n"
        )
    out.write(f"{'request':<12}{'finish':<8}{'tokens':>7}{'TTFT ms':>10}{'tok/s':>8}  text\n")
    for t in tracks:
        out.write(_summary_line(t) + "\n")
    return 0


def _summary_line(t: _Track) -> str:
    """One row of the demo's closing table: finish, tokens, TTFT, rate, the text's start."""
    ttft = (t.first_token_at - t.start) * 1000 if t.first_token_at else float("nan")
    dur = (t.end or time.monotonic()) - (t.first_token_at or t.start)
    rate = (t.num_tokens - 1) / dur if t.num_tokens > 1 and dur > 0 else float("nan")
    text = _head_words(t.prompt + t.text, 80)
    return (
        f"{t.label:<12}{t.finish_reason or '-':<8}{t.num_tokens:>7}{ttft:>10.1f}{rate:>8.1f}  "
        f"{text}"
    )


def run_generate(
    prompt: str,
    model: str | None,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    out: TextIO = sys.stdout,
) -> int:
    """Stream one completion to ``out``."""
    import nbengine as nb

    with nb.Engine(model) as engine:
        params = nb.SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            output_kind=nb.RequestOutputKind.DELTA,
        )
        handle = engine.generate(prompt, params)  # validates first: nothing printed yet
        out.write(prompt)
        for chunk in handle:
            out.write(chunk.outputs[0].text)
            out.flush()
        out.write("\n")
    return 0


def run_bench_cli(args: argparse.Namespace) -> int:
    """``nbengine bench``: run, print the table, optionally write the JSON report."""
    import json

    from nbengine.bench import BenchConfig, format_report, run_bench
    from nbengine.bench.config import peer_engines

    engines = _bench_engines(args)
    skipped: dict[str, str] = {}
    if args.peers:
        engines, skipped = peer_engines()
        for e, why in skipped.items():
            print(f"--peers: skipping {e}: {why}", file=sys.stderr, flush=True)
    model = check_model_arg(args.model)
    if model is not None and not Path(model).is_dir():  # a Hub id: the engines need files
        from nbengine.model import resolve_model_dir

        model = str(resolve_model_dir(model))
    config = BenchConfig(
        model_dir=model,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        engines=engines,
        dtype=args.dtype,
        quantization=args.quantization,
        scale=0.1 if args.quick else args.scale,
        repeats=args.repeats,
        abort_latency=not args.no_abort,
        threads=args.threads,
        omp_wait_policy=args.omp_wait_policy,
    )
    report = run_bench(config, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.peers:
        report["config"]["skipped_engines"] = skipped
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if args.chart:
        _write_charts(report, args.chart)
    return 0


def _bench_engines(args: argparse.Namespace) -> tuple[str, ...]:
    """``--engines`` as a tuple of names."""
    return tuple(e.strip() for e in args.engines.split(",") if e.strip())


def _write_charts(report: dict[str, object], path: str) -> None:
    """``--chart``: the bar chart of each workload as HTML (PATH, or PATH-W1.html ... for
    several workloads)."""
    from nbengine.bench import peers_figure

    results = report["results"]
    assert isinstance(results, dict)
    target = Path(path)
    for w in results:
        out = target if len(results) == 1 else target.with_name(f"{target.stem}-{w}{target.suffix}")
        peers_figure([report], w).write_html(out)
        print(f"chart of {w}: {out}", file=sys.stderr, flush=True)


DESCRIPTION = "nbengine: an LLM inference engine that runs inside your Jupyter kernel."
EPILOG = "Run 'nbengine COMMAND --help' for a command's options."
# Each command's line in `nbengine --help` (argparse lists them from here, once). Where a
# command needs an optional extra, the line says which (README, "The command line").
COMMAND_HELP: dict[str, str] = {
    "demo": "stream several prompts at once, cancel one, reuse its id",
    "generate": "stream one completion of a prompt to the terminal",
    "bench": "measure throughput and latency (needs transformers)",
    "serve": "serve an OpenAI-compatible HTTP API (needs the serve extra)",
    "tutorials": "open the tutorials in JupyterLab (needs the notebook extra)",
    "install-kernel": "install the 'nbengine' Jupyter kernel (for the tutorials)",
}

EXIT_USAGE = 2  # a bad argument or value: argparse's own status for usage errors


class CliError(Exception):
    """A value the user gave cannot be used; the message is the whole explanation."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage block is in ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def check_model_arg(model: str | None, option: str = "--model") -> str | None:
    """The model a command was given, checked before anything loads; every command that
    takes a model (``demo``, ``generate``, ``bench``, ``serve``) resolves it here.

    An existing path must be a model directory (returned expanded); anything else must
    read as a Hugging Face Hub id ("org/name"), returned as given for ``nb.Engine`` to
    resolve (the Hub cache, else a download; docs/models.md). None (the shipped default
    model) stays None. Raises ``CliError`` naming ``option`` otherwise.
    """
    if model is None:
        return None
    from nbengine.model.hub import is_hub_repo_id

    p = Path(model).expanduser()
    if not p.exists():
        if is_hub_repo_id(model):
            return model
        raise CliError(
            f"{option} {model}: no such directory (and not a Hugging Face Hub id such as org/name)"
        )
    if not p.is_dir():
        raise CliError(f"{option} {model}: not a directory (give a Hugging Face model folder)")
    if not (p / "config.json").is_file():
        raise CliError(
            f"{option} {model}: not a model directory (it has no config.json; give a "
            "Hugging Face model folder with config.json, weights and a tokenizer)"
        )
    return str(p)


@dataclass(frozen=True, slots=True)
class Requirement:
    """A package a command needs beyond the base install, and the extra that brings it."""

    module: str  # the importable name, looked up with importlib.util.find_spec
    extra: str  # the group in pyproject.toml's [project.optional-dependencies]
    note: str = ""  # appended to the install hint


_SERVE_NEEDS = (Requirement("starlette", "serve"), Requirement("uvicorn", "serve"))
_TRANSFORMERS_NOTE = (
    " (the bench extra also compiles llama.cpp, 5-15 minutes; for the default engines "
    "pip install transformers is enough)"
)


def requirements(args: argparse.Namespace) -> list[Requirement]:
    """What ``args.command`` needs beyond the base install (the README's table)."""
    if args.command == "serve":
        return list(_SERVE_NEEDS)
    if args.command == "bench":
        from nbengine.bench.config import ENGINE_PACKAGES

        # The report names transformers' version and the default engines run on it.
        needs = [Requirement("transformers", "bench", _TRANSFORMERS_NOTE)]
        if not args.peers:  # --peers skips the peers that are not installed, by name
            for module in dict.fromkeys(ENGINE_PACKAGES.get(e) for e in _bench_engines(args)):
                if module is not None and module != "transformers":
                    needs.append(Requirement(module, "bench"))
        return needs
    if args.command == "tutorials" and not args.no_lab:  # --no-lab only copies
        return [Requirement("jupyterlab", "notebook")]
    return []


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec: it is there
        return True
    except ImportError:  # a parent package is missing
        return False


def check_requirements(args: argparse.Namespace) -> None:
    """Refuse, in one line naming the extra, a command whose packages are not installed,
    before it does any work (loads a model, copies files, starts processes)."""
    for need in requirements(args):
        if not _installed(need.module):
            raise CliError(
                f"nbengine {args.command} needs {need.module} (the {need.extra} extra), "
                f'which is not installed: pip install "nbengine[{need.extra}]"{need.note}'
            )


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it has one worth reading (not None or off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    fmt = _DefaultsFormatter
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the full Python traceback of an error",
    )
    parser = _Parser(
        prog="nbengine",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the full Python traceback of an error"
    )
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    model_help = (
        "Hugging Face model directory or Hub id, e.g. org/name (default: the shipped default model)"
    )

    demo = sub.add_parser(
        "demo",
        parents=[common],
        formatter_class=fmt,
        help=COMMAND_HELP["demo"],
        description="Stream several prompts at once from one engine, cancel one mid-stream "
        "(abort() returns once the core has freed it), reuse its id, and print "
        "a summary. CPU only, offline.",
    )
    demo.add_argument("--model", default=None, help=model_help)
    demo.add_argument(
        "--max-tokens", type=_positive_int, default=48, help="tokens to generate per prompt"
    )

    gen = sub.add_parser(
        "generate",
        parents=[common],
        formatter_class=fmt,
        help=COMMAND_HELP["generate"],
        description="Stream the completion of PROMPT to stdout as it is generated.",
    )
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", default=None, help=model_help)
    gen.add_argument(
        "--max-tokens", type=_positive_int, default=64, help="the most tokens to generate"
    )
    gen.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        help="sampling temperature; 0 is greedy (always the likeliest token)",
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed, for repeatable sampling when temperature > 0",
    )

    bench = sub.add_parser(
        "bench",
        parents=[common],
        formatter_class=fmt,
        help=COMMAND_HELP["bench"],
        description="Run fixed workloads through nbengine and transformers, every run in a "
        "fresh process with the same environment, and compare them with this "
        "machine's memory-bandwidth bound (docs/benchmarks.md). Needs transformers: "
        'pip install transformers, or pip install "nbengine[bench]" for every peer.',
    )
    bench.add_argument(
        "--model",
        default=None,
        help="model directory or Hub id (default: random weights in SmolLM2-135M's shape)",
    )
    bench.add_argument("--workloads", default="W1,W2,W3", help="comma-separated: W1,W2,W3")
    bench.add_argument(
        "--engines",
        default="nbengine,hf_static,hf_cb",
        help="comma-separated: nbengine,hf_static,hf_cb,ct2,llamacpp (ct2: "
        "CTranslate2, llamacpp: llama.cpp; both in the bench extra)",
    )
    bench.add_argument(
        "--peers",
        action="store_true",
        help="nbengine, the transformers engines, ct2 and llamacpp (those installed; "
        "the skipped ones are named), instead of --engines",
    )
    bench.add_argument(
        "--chart",
        metavar="PATH",
        help="also write the plotly bar chart of tokens/s per engine, with the bound, as "
        "HTML (PATH-W1.html ... for several workloads; in a notebook, "
        "nbengine.bench.run_peers shows it inline)",
    )
    bench.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="weights and compute type",
    )
    bench.add_argument(
        "--quantization",
        default=None,
        choices=("int8", "int4", "int4-g32"),
        help="nbengine's weights quantized (docs/quantization.md); the "
        "bandwidth bound counts the quantized bytes",
    )
    bench.add_argument("--scale", type=float, default=1.0, help="shrink workloads (e.g. 0.1)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="same as --scale 0.1: a smoke run, still a fresh process per engine and "
        "workload (about 2.5 minutes on 2 cores)",
    )
    bench.add_argument(
        "--repeats", type=_positive_int, default=1, help="runs of each engine on each workload"
    )
    bench.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads for every engine (default: physical cores)",
    )
    bench.add_argument(
        "--omp-wait-policy",
        default=None,
        choices=("PASSIVE", "ACTIVE"),
        help="OMP_WAIT_POLICY of every engine's process (default: each engine's faster one, "
        "ACTIVE for ct2, PASSIVE for the others)",
    )
    bench.add_argument("--no-abort", action="store_true", help="skip the abort() latency check")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the report here")

    from nbengine.server.cli import add_serve_parser

    add_serve_parser(sub, [common], fmt, COMMAND_HELP["serve"])

    tut = sub.add_parser(
        "tutorials",
        parents=[common],
        formatter_class=fmt,
        help=COMMAND_HELP["tutorials"],
        description="Copy the tutorial notebooks into DIR (once; your edits are kept) and "
        "start JupyterLab on the first one. The copies, not the tracked "
        "notebooks/, get your outputs. Other options go to jupyter lab "
        "(e.g. --no-browser --port 8890). Needs the notebook extra: "
        'pip install "nbengine[notebook]" and nbengine install-kernel.',
    )
    tut.add_argument("--dir", default="tutorials", help="where the copies go")
    tut.add_argument(
        "--fresh",
        action="store_true",
        help="replace copies already in DIR with the shipped notebooks",
    )
    tut.add_argument(
        "--no-lab",
        action="store_true",
        help="only copy, and print the command that starts JupyterLab",
    )

    kern = sub.add_parser(
        "install-kernel",
        parents=[common],
        help=COMMAND_HELP["install-kernel"],
        description="Install the 'nbengine' Jupyter kernel, which the tutorials in "
        "notebooks/ run under.",
    )
    where = kern.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the user's Jupyter data dir")
    where.add_argument("--sys-prefix", action="store_true", help="into this environment (default)")
    return parser


def _run(args: argparse.Namespace) -> int:
    check_requirements(args)
    if args.command == "demo":
        return run_demo(check_model_arg(args.model), args.max_tokens)
    if args.command == "generate":
        return run_generate(
            args.prompt, check_model_arg(args.model), args.max_tokens, args.temperature, args.seed
        )
    if args.command == "bench":
        return run_bench_cli(args)
    if args.command == "serve":
        from nbengine.server.cli import run_serve

        return run_serve(args)
    if args.command == "tutorials":
        from nbengine.tutorials import open_tutorials

        return open_tutorials(
            Path(args.dir), fresh=args.fresh, launch=not args.no_lab, lab_args=args.lab_args
        )
    if args.command == "install-kernel":
        from nbengine.kernelspec import install_kernel

        path = install_kernel(user=args.user, sys_prefix=args.sys_prefix)
        print(f"Installed kernelspec 'nbengine' in {path}")
        return 0
    raise CliError(f"unknown command {args.command}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad argument or value)."""
    parser = _parser()
    # Options `tutorials` does not know go to `jupyter lab` (--no-browser, --port, ...).
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "tutorials":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.lab_args = extra
    debug = bool(getattr(args, "debug", False))
    try:
        return _run(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("nbengine: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, OSError) as e:
        # Values the user gave (ModelLoadError and the SamplingParams / prompt checks are
        # ValueErrors): one line, unless --debug asks for the traceback.
        if debug:
            traceback.print_exc()
        sys.stdout.flush()
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"nbengine: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
