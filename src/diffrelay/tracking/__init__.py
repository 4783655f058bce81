"""Tracking: publishing a run to experiment trackers (W&B, MLflow) from what its jobs already wrote. No tracker
code runs in training, sampling or scoring: the workflow's local `track` jobs (`diffrelay track`) read the run
folder (`records`), send what the per-tracker ledger (`ledger`) has not recorded yet through each sink
(`wandb_sink`, `mlflow_sink`) under one lock (`publish`). `settings` holds the torch-free config rules, ids and
the privacy filter. wandb and mlflow are imported only by their sinks, only when configured.

Imports the base modules, runtime (claims: the lock) and evaluation (protocol: folder names; columns: metrics.csv's
scores, read as the report reads them).
"""
