"""One layout's training engine: process groups and meshes, the Llama model, tensor / pipeline / FSDP2
parallelism, the optimizer and learning rate, and the gradient statistics from the backward pass.

May import: torch, copus.core.
"""
