"""Implementations of the `pipeline` subcommands (imported lazily by the CLI)."""
