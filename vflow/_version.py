"""The one version string of vflow (setup.py reads this file as text)."""

__version__ = "0.3.0"
