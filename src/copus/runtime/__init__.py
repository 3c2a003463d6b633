"""The torch integration of copus: model, data, parallelism, statistics, trainer, checkpoints."""
