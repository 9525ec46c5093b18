"""Asynchronous actor-model KL-PPO pipeline for language models (the library)."""

__version__ = "0.1.0"
