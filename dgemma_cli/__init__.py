"""dgemma: run DiffusionGemma locally.

The Python API (see docs/python.md):

    import dgemma_cli as dg
    model = dg.load("path/to/checkpoint")
    result = model.generate("Why is the sky blue?", seed=0)
    print(result.texts[0])

Heavy modules (torch) are imported lazily so that `import dgemma_cli` and `dgemma --help` stay fast.
"""

from .device import prepare_cpu_runtime

__version__ = "0.1.0"

# Before any dgemma module imports torch: OpenMP threads that sleep while they wait, so that a busy neighbour process
# does not make generation on the CPU tens of times slower (see device.py). A no-op if torch is already imported.
prepare_cpu_runtime()

__all__ = ["load", "Engine", "GenerationSettings", "__version__"]


def __getattr__(name):
    if name in ("load", "Engine"):
        from . import engine

        return getattr(engine, name)
    if name == "GenerationSettings":
        from .config import GenerationSettings

        return GenerationSettings
    raise AttributeError(name)
