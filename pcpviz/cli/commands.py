"""pcpviz: vLLM 0.33.0's Prefill Context Parallel (PCP) + MTP data path, rank by rank.

    pcpviz layout --pcp 2 --batch p13,d1,d4          # DualChunkSwap rows, maps, write mask
    pcpviz layout --pcp 4 --batch p40,d2@31 --decodes replicated --dcp 4 --pad 48
    pcpviz layout --pcp 2 --batch p13,d1 --json      # the layout as JSON
    pcpviz run --pcp 2 --mtp 2 --device cpu --prompt "def f(" --trace runs/demo --json out.json
    pcpviz run --list-faults
    pcpviz check runs/demo                            # every invariant, first violation named
    pcpviz diff runs/demo runs/bad                    # first divergence + acceptance
    pcpviz explain runs/bad runs/demo                 # the most likely cause, with the evidence
    pcpviz export runs/demo --html runs/demo.html
    pcpviz replay --pcp 2 --mtp 2 --trace runs/vllm   # the real vLLM code on CPU
    pcpviz bisect --graph-mode PIECEWISE --out runs/b # which knob flips acceptance or tokens
    pcpviz synth --tokens 131072 --trace runs/synth   # a synthetic trace with a 128k-token step

Also `python -m pcpviz ...`. Exit codes: 0 ok, 1 a check failed or runs differ, 2 bad input
(one-line reason on stderr; an invalid run.json too), 3 incomplete trace (data lost: a missing or
unreadable rank file, steps dropped after a damaged record, steps missing on some ranks; one
"incomplete:" line each on stderr; a run that did not finish or is being written), 130/143
`pcpviz run` stopped by SIGINT/SIGTERM (its trace marked partial), 141 stdout closed early (| head).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from pcpviz.cli.guard import (EXIT_BAD_INPUT, EXIT_INCOMPLETE, Incomplete, UsageError, named_stdout, terminal_safe,
                              system_error)
from pcpviz.cli.bisect_command import add_bisect
from pcpviz.cli.findings_command import add_findings
from pcpviz.cli.layout_command import add_layout
from pcpviz.cli.replay_command import add_replay
from pcpviz.cli.run_command import add_run
from pcpviz.cli.synth_command import add_synth
from pcpviz.cli.trace_commands import add_check, add_diff, add_explain, add_export

__all__ = ["main", "build_parser", "SUBCOMMANDS"]


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (examples keep their lines); every option that has a default
    shows it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" not in text and action.option_strings and action.default not in (
                None, False, argparse.SUPPRESS) and not action.required:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise UsageError(f"{self.prog}: {message}")


# Each subcommand is one module's add_<name>(sub); `pcpviz --help` lists them in this order.
SUBCOMMANDS: list[Callable] = [add_layout, add_run, add_check, add_diff, add_export, add_explain, add_replay,
                               add_bisect, add_findings, add_synth]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pcpviz", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with named_stdout():
        try:
            args = build_parser().parse_args(argv)
            code = int(args.func(args))
            sys.stdout.flush()  # a full disk or a closed pipe on stdout is reported here, not at exit
            return code
        except UsageError as e:
            print(terminal_safe(str(e).splitlines()[0]), file=sys.stderr)
            return EXIT_BAD_INPUT
        except Incomplete as e:
            if str(e):  # empty: its line is on stderr already
                print(terminal_safe(str(e).splitlines()[0]), file=sys.stderr)
            return EXIT_INCOMPLETE
        except (OSError, MemoryError, RecursionError) as e:  # `| head`, a name too long, a full disk
            return system_error(argv, e)


if __name__ == "__main__":
    sys.exit(main())
