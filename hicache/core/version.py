"""The package version (one place; the CLI's --version and the daemon's heartbeat read it)."""
__version__ = "0.1.0"
