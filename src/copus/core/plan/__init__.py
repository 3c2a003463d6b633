"""The plan space and choosing in it: a parallel plan (dp x tp x pp, micro-batching), layout names and
maps, pipeline stages, resharding costs, the records of steps and decisions, goodput and the plan search.

May import: copus.core.specs, copus.core.stats (no torch).
"""
