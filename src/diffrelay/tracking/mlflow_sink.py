"""Sending a batch to MLflow: one MLflow run per diffrelay run, found by its tag diffrelay.run_id in the
experiment (created on first use), continued by each `track` job under the run's lock. Every value is logged
at its own step (training's, or the checkpoint's for scores and grids), so late scores keep their place, and
with the time its record was written (train.jsonl's `time`, the score file's `finished`), not the time of
sending: a batch re-sent after a partial failure repeats exact (key, value, timestamp, step) rows, which
MLflow's SQL store skips (SqlAlchemyStore._log_metrics), so no value appears twice.

The default store is sqlite:///mlflow.db in the working directory (MLflow's own default, so `mlflow ui` there
shows the run); the file store (./mlruns) refuses to start since MLflow 3.17 unless MLFLOW_ALLOW_FILE_STORE=true.
Only MlflowClient is used: MLflow's fluent API would add the user name and the script's path as tags.
"""

BATCH = 1000  # MLflow's limit of metrics per log_batch call
TAG = "diffrelay.run_id"


def find_run(client, experiment: str, ident: dict) -> str:
    exp = client.get_experiment_by_name(experiment)
    eid = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    found = client.search_runs([eid], filter_string=f"tags.`{TAG}` = '{ident['id']}'", max_results=1)
    if found:
        return found[0].info.run_id
    tags = {TAG: ident["id"], "diffrelay.trajectory": ident["trajectory"]}
    return client.create_run(eid, tags=tags, run_name=ident["name"]).info.run_id


def send(cfg: dict, ident: dict, batch: dict, where) -> None:
    """Log `batch` (ledger.pending's shape) to the run `ident` names; any failure raises."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    from PIL import Image

    client = MlflowClient(tracking_uri=cfg.get("tracking_uri") or "sqlite:///mlflow.db")
    run_id = find_run(client, cfg.get("experiment") or "diffrelay", ident)
    times = batch.get("times") or {}
    metrics = [Metric(f"train/{k}", v, times.get(("train", step), 0), step)
               for step, values in sorted(batch["train"].items()) for k, v in values.items()]
    metrics += [Metric(f"eval/{series}/{k}", v, times.get((series, step), 0), step)
                for (series, step), values in sorted(batch["evals"].items()) for k, v in values.items()]
    for i in range(0, len(metrics), BATCH):
        client.log_batch(run_id, metrics=metrics[i:i + BATCH], synchronous=True)
    for (series, step), path in sorted(batch["grids"].items()):
        with Image.open(path) as img:
            client.log_image(run_id, img.convert("RGB"), key=f"samples/{series}", step=step, synchronous=True)
    if batch["config"] is not None:
        client.log_dict(run_id, batch["config"], "diffrelay/config.json")
        client.set_tag(run_id, "diffrelay.trajectory", ident["trajectory"])
