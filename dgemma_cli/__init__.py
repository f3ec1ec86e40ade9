"""dgemma: run DiffusionGemma locally.

The Python API (see README):

    import dgemma_cli as dg
    model = dg.load("path/to/checkpoint")
    result = model.generate("Why is the sky blue?", seed=0)
    print(result.texts[0])

Heavy modules (torch) are imported lazily so that `import dgemma_cli` and `dgemma --help` stay fast.
"""

__version__ = "0.1.0"

__all__ = ["load", "Engine", "GenerationSettings", "__version__"]


def __getattr__(name):
    if name in ("load", "Engine"):
        from . import engine

        return getattr(engine, name)
    if name == "GenerationSettings":
        from .config import GenerationSettings

        return GenerationSettings
    raise AttributeError(name)
