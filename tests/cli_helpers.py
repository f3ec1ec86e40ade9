"""Running the `dgemma` entry point in-process, for the CLI tests."""

from dgemma_cli.cli import main


def run_main(args) -> int:
    """Call `dgemma ARGS` as the console script would; return its exit code."""
    try:
        main(list(args))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def interrupt_after_first_canvas(monkeypatch) -> None:
    """Make the engine's event stream raise KeyboardInterrupt right after its first finished canvas, as a Ctrl-C
    while the second canvas is being denoised would."""
    import dgemma_cli.engine as engine_mod
    from dgemma_cli.sampler import CanvasDone

    real = engine_mod.generate_events

    def interrupted(*args, **kwargs):
        for ev in real(*args, **kwargs):
            yield ev
            if isinstance(ev, CanvasDone):
                raise KeyboardInterrupt

    monkeypatch.setattr(engine_mod, "generate_events", interrupted)
