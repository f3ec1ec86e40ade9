"""Running the `dgemma` entry point in-process, for the CLI tests."""

from dgemma_cli.cli import main


def run_main(args) -> int:
    """Call `dgemma ARGS` as the console script would; return its exit code."""
    try:
        main(list(args))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
