"""One module per `copus` subcommand; each defines `add_arguments(parser)` and `run(args)`.

Command modules must import torch lazily (inside `run`), so `copus --help` stays fast.
"""
