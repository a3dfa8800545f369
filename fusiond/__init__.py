"""fusiond: the fusion peer daemon, and the library that trains."""

__version__ = "0.1.0"
