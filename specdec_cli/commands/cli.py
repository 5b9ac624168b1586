"""The command line: parse, call, print. The work happens in the modules it calls."""

from __future__ import annotations

import difflib
import sys
from typing import Annotated

import typer

from specdec_cli import __version__, interrupt
from specdec_cli.commands.bench_command import bench
from specdec_cli.commands.model_commands import check, info
from specdec_cli.commands.run_command import run
from specdec_cli.commands.serve_command import serve
from specdec_cli.commands.worker_command import worker
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import rpc

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Lossless speculative decoding for llama.cpp GGUF models.",
)


def _print_version(value: bool) -> None:
    if value:
        from llama_cpp import __version__ as binding

        from specdec_cli.llamacpp.backend import backend_names

        backends = ", ".join(backend_names())
        remote = "built in" if rpc.built_in() else "not built in (see the README)"
        print(
            f"specdec {__version__} (llama-cpp-python {binding}; llama.cpp backends: "
            f"{backends}; RPC: {remote})"
        )
        raise typer.Exit()


def _list_devices(value: bool) -> None:
    if value:
        from specdec_cli.llamacpp.backend import device_list_text, gpu_devices

        print(device_list_text(gpu_devices()))
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Show versions and the backends llama.cpp was built with.",
        ),
    ] = False,
    list_devices: Annotated[
        bool,
        typer.Option(
            "--list-devices",
            callback=_list_devices,
            is_eager=True,
            help="List the devices -dev/-devd can name (GPUs), as llama.cpp does.",
        ),
    ] = False,
) -> None:
    """Lossless speculative decoding for llama.cpp GGUF models."""


# The commands, in the order --help lists them (each module holds one command's flags).
for command in (run, bench, serve, worker, info, check):
    app.command()(command)


def main() -> None:
    """Console entry point: turn expected failures into one line and an exit code."""
    try:
        result = app(standalone_mode=False, prog_name="specdec")
    except UserError as err:
        _fail(str(err), err.exit_code)
    except typer.TyperException as err:  # bad flags: click's usage errors, as typer raises them
        _fail_usage(err)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(interrupt.EXIT_CODE)
    # With standalone_mode=False, click returns typer.Exit's code instead of exiting.
    sys.exit(result if isinstance(result, int) else 0)


def _fail_usage(err: typer.TyperException) -> None:
    # typer raises its own copy of click's exceptions: told apart by name, not by class.
    if type(err).__name__ == "NoArgsIsHelpError":  # bare `specdec`: the help, as click does
        print(err.format_message(), file=sys.stderr)
        sys.exit(err.exit_code)
    if type(err).__name__ == "NoSuchOption":
        # click suggests any option a little alike (--bogus: "--verbose"); keep close ones.
        err.possibilities = difflib.get_close_matches(
            err.option_name, err.possibilities or [], cutoff=0.8
        )
    ctx = getattr(err, "ctx", None)
    hint = f" (see: {ctx.command_path} --help)" if ctx else ""
    _fail(f"{err.format_message()}{hint}", err.exit_code)


def _fail(message: str, code: int) -> None:
    print(f"specdec: error: {message}", file=sys.stderr)
    sys.exit(code)
