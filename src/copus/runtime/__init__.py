"""The torch integration of copus.

Packages, data flowing one way (config -> plan -> build -> loop -> statistics -> decision -> reconfigure):
    engine/   one layout's mesh, model, parallelism, optimizer, gradient statistics
    data/     tokenizers, shards, the global sample stream
    state/    checkpoints, run folder and metrics, layout switches, export
    train/    the trainer, launcher, stop, probes, profiling
"""
