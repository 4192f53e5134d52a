"""kd's version, in one place (the package, checkpoints and the CLI read it)."""

__version__ = "0.1.0"
