"""Training: one segment of the training loop (`train`, the `train` stage), the optimizer, schedule and
EMA (`optim`, `eager`), post-hoc EMA (`phema`), checkpoints and snapshots on disk (`checkpoint`), and a
model.pretrained run's snapshot as a diffusers pipeline folder (`export`, the `export` stage).

Imports the base modules, config, preflight, runtime, nets, objectives, data, text and pretrained.
"""
