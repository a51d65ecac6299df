"""mtplxctl: the command-line client of the mtplx daemon."""

from mtplxd import __version__

__all__ = ["__version__"]
