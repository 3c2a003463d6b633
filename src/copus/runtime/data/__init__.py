"""What a run reads: tokenizers, input sources, prepared token shards, the deterministic global sample
stream and its sampler.

May import: torch, numpy, copus.core.
"""
