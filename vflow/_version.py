"""The one place vflow's version is written: setup.py reads this file as text (it must
not import vflow, whose ``__init__`` needs torch and the built extension)."""

__version__ = "0.4.0"
