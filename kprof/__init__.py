"""kprof: a trustworthy number for the exact kernel, shape and GPU you ask about."""

__version__ = "0.1.0"
__all__ = ["__version__"]
