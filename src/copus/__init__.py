"""copus: co-adaptive batch size and 3D parallelism for LLM training.

`copus.core` is pure (stdlib + numpy/scipy, never torch); `copus.runtime` is the torch integration.
"""

__version__ = "0.1.0"
