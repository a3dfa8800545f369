"""fusionctl: the command-line client of fusiond (thin: it asks the daemon)."""

__version__ = "0.1.0"
