"""The package version, in a module of its own so modules below the front door (bundle.py) read it without importing
bpd_train/__init__.py's public names."""

__version__ = "0.1.0"
