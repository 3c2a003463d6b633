"""Statistics of training, from numbers alone: the gradient noise scale and its tracking, statistical
efficiency, the measured critical batch, Lau et al.'s batch tests, LR progress, step-time spread.

May import: the standard library and numpy / scipy only (no other copus package, no torch).
"""
