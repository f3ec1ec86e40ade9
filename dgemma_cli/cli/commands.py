"""The `dgemma` command line: the Typer app, its commands in the order `dgemma --help` lists them, and the entry point
that turns every failure into one line on stderr and an exit code. Thin on purpose: each command is a module of this
package that parses, checks and calls library code.

Nothing heavy is imported at module level: `dgemma --help` and usage errors never import torch.
Stdout carries only answers; diagnostics go to stderr as one line each, with documented exit codes:
0 ok, 1 runtime error, 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import os
import sys

import typer

from ..errors import EXIT_INTERRUPTED, EXIT_USAGE, DgemmaError
from .options import fail

app = typer.Typer(
    name="dgemma",
    help="Run DiffusionGemma locally: block diffusion, one canvas at a time.",
    add_completion=True,  # --install-completion, --show-completion: for the shell they run from (detected)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command: -h as in ollama, llm, llama.cpp
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    """Run DiffusionGemma locally: block diffusion, one canvas at a time."""
    if version:
        from .. import __version__

        sys.stdout.write(f"dgemma {__version__}\n")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        sys.stdout.write(ctx.get_help() + "\n")
        raise typer.Exit(0)



# The commands, in the order `dgemma --help` lists them. Each module imports only light things at its top: torch and
# the engine are imported inside a command, after its flags are checked.
from . import bench, chat, doctor, fim, models, plan, run, serve, tune  # noqa: E402

app.command()(run.run)
app.command()(chat.chat)
app.command()(fim.fim)
app.command()(serve.serve)
app.command()(tune.tune)
app.command()(models.pull)
app.command("list")(models.list_models)
app.command("ls", hidden=True, help="The same as `dgemma list` (as in ollama).")(models.list_models)
app.command()(models.info)
app.command()(models.show)
app.command()(models.rm)
app.command()(models.quantize)
app.command()(plan.plan)
app.command()(bench.bench)
app.command()(doctor.doctor)


def _click_exceptions():
    """Typer's parser exceptions: recent Typer vendors its own click, older releases use click itself."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def main(argv: list[str] | None = None) -> None:
    """Console entry point: every failure is one line on stderr and an exit code, never a traceback."""
    if (sys.argv[1:] if argv is None else list(argv)) == ["--version"]:
        # answered before Typer converts any parameter (which imports pydantic): about 0.1 s of 0.25 s
        from .. import __version__

        sys.stdout.write(f"dgemma {__version__}\n")
        raise SystemExit(0)
    ex = _click_exceptions()
    try:
        # Without standalone mode errors propagate to the handlers below, but Typer turns Ctrl-C into an
        # exit code that it *returns* (130), so the return value matters too.
        rc = app(args=argv, standalone_mode=False)
        if rc == EXIT_INTERRUPTED:
            fail("interrupted", EXIT_INTERRUPTED)
        if isinstance(rc, int) and rc != 0:
            raise SystemExit(rc)
    except DgemmaError as e:
        fail(str(e), e.exit_code)
    except ex.NoArgsIsHelpError:
        raise SystemExit(EXIT_USAGE) from None
    except ex.UsageError as e:
        hint = f" (see: dgemma {e.ctx.info_name} --help)" if e.ctx is not None and e.ctx.parent else ""
        fail(e.format_message().replace("\n", " ") + hint, EXIT_USAGE)
    except ex.ClickException as e:
        fail(e.format_message().replace("\n", " "), e.exit_code)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except SystemExit as e:
        # Click answers a write to a closed pipe (`dgemma run ... | head -n 1`) with exit 1 and nothing said, after
        # wrapping stdout in its (_)PacifyFlushWrapper (the name depends on click's version): the reader left,
        # which is no failure of ours.
        if e.code == 1 and type(sys.stdout).__name__.lstrip("_") == "PacifyFlushWrapper":
            raise SystemExit(0) from None
        raise
    except typer.Abort:
        fail("interrupted", EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): nothing more to say
        try:
            sys.stdout = open(os.devnull, "w")
        finally:
            raise SystemExit(0)
    except MemoryError:
        fail("out of memory: try a smaller --max-new-tokens or a quantized model", 1)
    except Exception as e:  # a bug, not bad input: still one line, with a way to see the traceback
        if os.environ.get("DGEMMA_DEBUG"):
            raise
        fail(f"internal error: {type(e).__name__}: {e} (set DGEMMA_DEBUG=1 for the traceback)", 1)