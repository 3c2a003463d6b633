"""The training loop and its drivers: the trainer, the launcher and worker entry points, graceful stop,
branch probes of the critical batch, profiling.

May import: everything below it (copus.config, copus.core, copus.runtime.engine.engine / data / state).
"""
