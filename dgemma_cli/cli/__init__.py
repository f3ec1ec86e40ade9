"""The command line: `dgemma` and its commands (commands.py registers them; one module per command or group of
commands), the chat terminal (chat.py), the live canvas view (view.py), the files and holes of `dgemma fim` (fim.py).

Owns: parsing, checking every flag before torch is imported, what goes to stdout and stderr, exit codes.
May import anything in dgemma_cli; nothing imports it (the engine, the server, the store and the tuner never do).
This file imports nothing, so that `dgemma --help` and a usage error stay fast: `main` loads the app when called.
"""


def main(argv: list[str] | None = None) -> None:
    """The console entry point (pyproject.toml's `dgemma`), as dgemma_cli.cli.commands.main."""
    from .commands import main as run_main

    run_main(argv)


def __getattr__(name):
    if name == "app":  # the Typer app, for tests and for tools that introspect it
        from .commands import app

        return app
    raise AttributeError(name)
