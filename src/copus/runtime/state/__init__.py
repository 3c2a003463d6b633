"""What persists and moves: atomic checkpoints, the run folder and its metrics, layout switches in the
running processes (reconfigure / redistribute), the elastic resume plan, Hugging Face export.

May import: torch, copus.config, copus.core, copus.runtime.engine.engine, copus.runtime.data.stream.
"""
