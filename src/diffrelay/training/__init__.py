"""Training: one segment of the training loop (`train`, the `train` stage), the optimizer, schedule and
EMA (`optim`), post-hoc EMA (`phema`) and checkpoints and snapshots on disk (`checkpoint`).

Imports the base modules, config, preflight, runtime, nets, objectives, data and text.
"""
