"""Prompt datasets: the RL row schema, loaders, a resumable cursor, and self-made tasks."""
