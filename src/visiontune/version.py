"""The package version, in a module of its own so that the run records can name it without
importing the package root (which would import every wing)."""

__version__ = "0.1.0"
