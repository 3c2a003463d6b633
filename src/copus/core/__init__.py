"""Pure logic of copus: statistics, models of throughput and memory, planning, control.

Nothing under `copus.core` may import torch (tests/core/test_no_torch.py enforces it).
"""
