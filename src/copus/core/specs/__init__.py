"""What is trained and on what: model shapes (presets, Hugging Face config.json), hardware profiles,
cluster topology.

May import: the standard library only (no other copus package, no torch).
"""
