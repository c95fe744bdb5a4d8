"""The ``nbengine`` command: ``demo``, ``generate``, ``bench``, ``serve``, ``tutorials``,
``install-kernel``.

A bad value (``--max-tokens 0``, a missing model directory, an empty prompt, ...) prints
one line, ``nbengine: error: ...``, and exits with status 2, as argparse does for a
bad option; ``--debug`` shows the traceback instead. So does a command whose optional
dependencies are missing (``serve`` without the serve extra, ``bench`` without
transformers): it is checked before any work, and the line names the extra to install.

This module is the parser and the dispatch; the demo is nbengine/demo.py, and ``bench``
and ``serve`` add their own options and runs (nbengine/bench/cli.py,
nbengine/server/cli.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

from nbengine.cli_args import CliError, check_model_arg, positive_int


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


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage block is in ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


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
        from nbengine.bench.cli import bench_engines
        from nbengine.bench.config import ENGINE_PACKAGES

        # The report names transformers' version and the default engines run on it.
        needs = [Requirement("transformers", "bench", _TRANSFORMERS_NOTE)]
        if not args.peers:  # --peers skips the peers that are not installed, by name
            for module in dict.fromkeys(ENGINE_PACKAGES.get(e) for e in bench_engines(args)):
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
        "--max-tokens", type=positive_int, default=48, help="tokens to generate per prompt"
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
        "--max-tokens", type=positive_int, default=64, help="the most tokens to generate"
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

    # The heavier commands add their own options (bench/cli.py, server/cli.py).
    from nbengine.bench.cli import add_bench_parser
    from nbengine.server.cli import add_serve_parser

    add_bench_parser(sub, [common], fmt, COMMAND_HELP["bench"])
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
        from nbengine.demo import run_demo

        return run_demo(check_model_arg(args.model), args.max_tokens)
    if args.command == "generate":
        return run_generate(
            args.prompt, check_model_arg(args.model), args.max_tokens, args.temperature, args.seed
        )
    if args.command == "bench":
        from nbengine.bench.cli import run_bench_cli

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
