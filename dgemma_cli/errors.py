"""User-facing errors. Each one is printed as a single line on stderr and maps to an exit code.

Library code raises these; only the CLI turns them into exit codes. Nothing here imports torch.
"""

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class DgemmaError(Exception):
    """An error the user can act on; the message is one line and says what to do."""

    exit_code = EXIT_RUNTIME


class UsageError(DgemmaError):
    """Bad flags or bad input text (empty prompt, prompt longer than the context)."""

    exit_code = EXIT_USAGE


class ModelError(DgemmaError):
    """A model directory that is missing, not DiffusionGemma, or damaged."""

    exit_code = EXIT_RUNTIME


class Interrupted(DgemmaError):
    """Ctrl-C during work that can be resumed: the message says how."""

    exit_code = EXIT_INTERRUPTED
