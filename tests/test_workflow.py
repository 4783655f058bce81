"""The Snakemake workflow: formatting, lint, the DAG it plans, config errors, and real tiny runs."""

import collections
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import BIN, REPO, TINY, deep_merge, run_cli

from diffrelay import config as drconfig

SNAKEFILE = REPO / "Snakefile"


def snakemake(workdir, *args, check=True, cores=2, timeout=900):
    """Run the repo's workflow with `workdir` as working directory (logs, .snakemake live there)."""
    return run_cli("snakemake", "--snakefile", SNAKEFILE, "--directory", workdir, "--cores", cores,
                   *args, check=check, timeout=timeout)


def job_counts(output: str) -> dict:
    """The first `Job stats` table Snakemake prints: {rule: count}."""
    table = output.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def finished_rules(output: str) -> collections.Counter:
    """Rules of the jobs that actually ran in a real (not dry) run."""
    return collections.Counter(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", output))


# --- fast: quality gates ------------------------------------------------------------------------
def test_workflow_files_are_snakefmt_formatted():
    p = subprocess.run([BIN / "snakefmt", "--check", SNAKEFILE, REPO / "workflow/rules"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_snakemake_lint_reports_nothing(tmp_path, write_config):
    p = snakemake(tmp_path, "--lint", "--configfile", write_config(), check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Congratulations, your workflow is in a good condition" in out, out


DERIVING = {"input", "output", "threads", "resources"}  # a params function taking one is no rerun trigger (Snakemake)
CONFIG_LIST = {"CONFIG_ARGS", "CONFIG_FILES"}


def workflow_sources() -> dict:
    """{file name: text} of the Snakefile and every rule file."""
    return {p.name: p.read_text() for p in [SNAKEFILE, *sorted((REPO / "workflow" / "rules").glob("*.smk"))]}


def test_no_rule_param_holds_the_config_file_list():
    """Snakemake reruns a job whose non-derived params changed: the list of config files there (compute_val_loss had
    `config=CONFIG_ARGS`) reran every finished job after an empty `{}` file was added or a file renamed. Each
    params function that uses the list must take `threads` (derived, as get_config_args does)."""
    import ast
    import textwrap

    funcs, blocks = {}, []
    for name, text in workflow_sources().items():
        for m in re.finditer(r"^def \w+\(.*?(?=^\S)", text + "\nEND", re.M | re.S):
            node = ast.parse(m.group(0)).body[0]
            funcs[node.name] = node
        blocks += [(name, b) for b in re.findall(r"^    params:\n((?:(?:        .*|\s*)\n)+)", text, re.M)]
    assert len(blocks) >= 10 and "get_config_args" in funcs

    def used(node, seen=()) -> set:
        """Names `node` reads, through the workflow functions it calls."""
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        for f in names & set(funcs) - set(seen):
            names |= used(funcs[f], (*seen, f))
        return names

    def derived(node) -> bool:
        if isinstance(node, ast.Name) and node.id in funcs:
            node = funcs[node.id]
        return isinstance(node, (ast.Lambda, ast.FunctionDef)) and bool(DERIVING & {a.arg for a in node.args.args})

    bad = []
    for name, block in blocks:
        call = ast.parse("f(\n" + textwrap.dedent(block) + "\n)").body[0].value
        bad += [f"{name}: params.{k.arg}" for k in call.keywords if not derived(k.value) and used(k.value) & CONFIG_LIST]
    assert not bad, bad


# --- fast: the planned DAG ----------------------------------------------------------------------
def test_dry_run_plans_one_training_job_per_segment(tmp_path, write_config):
    cfg = write_config({"train": {"total_steps": 9, "segment_steps": 3}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg)
    # Sampling and FID jobs appear only once a segment has run and its snapshots are known.
    assert job_counts(p.stdout) == {"fetch_extractor": 1, "prepare_dataset": 1, "compute_reference": 1,
                                    "train_segment": 3, "collect_segment": 3, "build_report": 1, "all": 1}
    commands = re.findall(r"diffrelay launch --standalone --nproc-per-node 1 -m diffrelay train .*", p.stdout)
    assert sorted(re.search(r"--until-step (\d+)", c).group(1) for c in commands) == ["3", "6", "9"]
    assert sum("--init" in c for c in commands) == 2


def test_dry_run_names_the_command_that_shows_the_merged_config(tmp_path, write_config):
    cfg = write_config({"sample": {"num_images": 12}, "fid": {"ref_images": 0}})
    p = snakemake(tmp_path, "-n", "--configfile", REPO / "config/config.yaml", cfg)
    line = next(x for x in p.stderr.splitlines() if "see the merged config with:" in x)
    command = shlex.split(line.split("see the merged config with: ", 1)[1])
    assert command[:2] == ["diffrelay", "validate"] and command[2::2] == ["--config", "--config"]
    assert command[3::2] == [str(REPO / "config/config.yaml"), str(cfg)]
    shown = yaml.safe_load(run_cli(*command[1:]).stdout)
    assert shown == drconfig.load([REPO / "config/config.yaml", cfg]).to_dict()
    assert shown["sample"]["num_images"] == 12 and shown["train"]["total_steps"] == 6  # both files count


def test_changed_segment_steps_keeps_trained_segments_and_retrains_nothing(tmp_path, write_config):
    cfg = write_config({"train": {"total_steps": 6, "segment_steps": 3}})
    run_cli("prepare", "--config", cfg)
    run_cli("train", "--config", cfg, "--until-step", 3)
    shorter = write_config({"train": {"total_steps": 6, "segment_steps": 2}}, name="shorter.yaml")
    p = snakemake(tmp_path, "-n", "--configfile", shorter)
    commands = re.findall(r"-m diffrelay train .*", p.stdout)
    # The trained segment (0, 3] stays; only (3, 5] and (5, 6] are new, and (3, 5] starts from step 3.
    assert sorted(int(re.search(r"--until-step (\d+)", c).group(1)) for c in commands) == [3, 5, 6]
    five = next(c for c in commands if "--until-step 5 " in c)
    assert "--init" in five and "checkpoints/step_0000003" in five


@pytest.mark.parametrize("name", ["config/config.yaml", "config/examples/real-data.yaml",
                                  "config/examples/own-images-cpu.yaml",
                                  "config/examples/slurm-multinode.yaml", "config/examples/unet-cifar10.yaml",
                                  "config/examples/pixel-dit-s2.yaml", "config/examples/flow-cpu.yaml"])
def test_shipped_configs_plan_their_segments(tmp_path, name):
    files = [REPO / "config/config.yaml", REPO / name]
    cfg = drconfig.load(files)
    # The templates point data.path at a folder relative to the working folder: give it two classes.
    if cfg.data.kind == "folder":
        for cls in ("cats", "dogs"):
            (tmp_path / cfg.data.path / cls).mkdir(parents=True)
            for i in range(2):
                (tmp_path / cfg.data.path / cls / f"{i}.png").write_bytes(b"")
    p = snakemake(tmp_path, "-n", "--configfile", *files)
    assert job_counts(p.stdout)["train_segment"] == len(drconfig.segment_ends(cfg))


def test_demo_runs_on_the_cpu_with_overlapping_one_core_jobs():
    cfg = drconfig.load(REPO / "config/config.yaml")
    assert cfg.run.device == "cpu" and cfg.fid.extractor == "random" and cfg.data.kind == "shapes"
    assert cfg.train.nproc_per_node * cfg.train.threads == 1 and cfg.sample.nproc * cfg.sample.threads == 1
    assert len(drconfig.segment_ends(cfg)) >= 3


def test_dag_drawing_shows_every_training_segment(tmp_path, write_config):
    # --dag and --report build the DAG without an executor; the training jobs must still be in it.
    cfg = write_config({"train": {"total_steps": 9, "segment_steps": 3}})
    p = snakemake(tmp_path, "--dag", "--configfile", cfg)
    labels = re.findall(r'label = "(\w+)', p.stdout)
    assert labels.count("train_segment") == 3 and labels.count("collect_segment") == 3, p.stdout + p.stderr


# --- fast: config errors stop the run before any job ------------------------------------------
def test_bad_config_fails_the_dry_run_with_one_line_naming_the_key(tmp_path, write_config):
    cfg = write_config({"train": {"batch_size": 30, "nproc_per_node": 4}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("diffrelay: error:")]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(errors) == 1 and "train.batch_size=30" in errors[0] and str(cfg) in errors[0]
    assert "Traceback" not in p.stderr and "Building DAG" not in p.stdout + p.stderr


def test_command_line_config_override_is_refused(tmp_path, write_config):
    p = snakemake(tmp_path, "-n", "--configfile", write_config(), "--config", "sample={num_images: 4}",
                  check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("diffrelay: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stdout + p.stderr
    assert "sample.num_images" in errors[0] and "--configfile" in errors[0]


def test_missing_extractor_file_is_refused_before_any_job(tmp_path, write_config):
    cfg = write_config({"fid": {"extractor": str(tmp_path / "nope.pt")}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg, check=False)
    assert p.returncode == 2 and "fid.extractor=" in p.stderr and "nope.pt" in p.stderr, p.stderr


def test_results_path_with_spaces_and_shell_characters_is_quoted_not_executed(tmp_path, write_config):
    nasty = tmp_path / "my results $(touch PWNED) ; touch PWNED2"
    cfg = write_config({"run": {"results": str(nasty)}})
    target = f"{nasty}/tiny/dataset"
    p = snakemake(tmp_path, target, "--configfile", cfg, cores=1)
    assert (nasty / "tiny" / "dataset" / "dataset.json").is_file(), p.stderr[-2000:]
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))


def test_multi_node_training_is_refused_without_slurm(tmp_path, write_config):
    cfg = write_config({"train": {"nnodes": 2}})
    p = snakemake(tmp_path, "--configfile", cfg, check=False)
    assert p.returncode == 2 and "train.nnodes=2" in p.stderr and "profiles/slurm" in p.stderr, p.stderr
    assert not (tmp_path / "results").exists()


def test_multi_node_training_runs_srun_torchrun_with_rendezvous(tmp_path, write_config):
    cfg = write_config({"train": {"nnodes": 2, "nproc_per_node": 2}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg)
    cmd = re.search(r"srun .*-m diffrelay train .*", p.stdout).group(0)
    assert "diffrelay launch --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d" in cmd
    assert '--rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID"' in cmd
    assert "--standalone" not in cmd and "--master-port" not in cmd
    # The jobstep plugin strips SLURM_* from the job: geometry is explicit, the nodes come from squeue.
    assert cmd.startswith("srun --kill-on-bad-exit=1 --nodes 2 --ntasks 2 --ntasks-per-node 1 ")
    assert 'squeue -h -j "$SLURM_JOB_ID" -o %N' in p.stdout and "SLURM_JOB_NODELIST" not in p.stdout


def test_slurm_profile_dry_run_names_the_placeholders_to_fill_in(tmp_path, write_config):
    # A machine without SLURM: PATH holds the venv and a few basic tools, no sinfo/sbatch/squeue.
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("which", "sh", "bash", "uname"):
        (tools / name).symlink_to(shutil.which(name))
    env = {"HOME": str(tmp_path), "PATH": f"{BIN}:{tools}"}
    p = run_cli("snakemake", "-n", "--snakefile", SNAKEFILE, "--directory", tmp_path, "--workflow-profile",
                REPO / "profiles" / "slurm", "--configfile", write_config(), check=False, env=env)
    errors = [line for line in p.stderr.splitlines() if line.startswith("diffrelay: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stdout + p.stderr
    assert "slurm_partition=<partition>" in errors[0] and "slurm_account=<account>" in errors[0], errors
    assert "profiles/README.md" in errors[0] and "Traceback" not in p.stderr


def test_a_stop_signal_says_stopped_not_failed_and_a_partial_run_names_no_report(tmp_path, write_config):
    """SIGTERM to Snakemake lets the running jobs finish and ends the run: no job failed, so the last line must
    not say "failed"; a run of one target made no report, so it must not point at one."""
    import signal
    import time

    cfg = write_config()
    out = tmp_path / "snakemake.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([BIN / "snakemake", "--snakefile", SNAKEFILE, "--directory", tmp_path, "--cores", "1",
                                 "--configfile", cfg], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "Shell command:" not in out.read_text():  # the first job has started
            assert proc.poll() is None and time.time() < deadline, out.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # Snakemake alone, as `kill PID` or a scheduler's stop does
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    last = [line for line in text.splitlines() if line.startswith("diffrelay: run")][-1]
    assert proc.returncode != 0 and "stopped by a signal; no job failed" in last and "failed; see" not in last, text
    dataset = tmp_path / "results" / "tiny" / "dataset"
    # With one core the stop let exactly one job finish, prepare_dataset or fetch_extractor (the scheduler picks
    # either): ask for both so this run has work to do whichever it was (a run with nothing to do prints no end).
    extractor = tmp_path / "resources" / "extractors" / "random-seed0.pt"
    p = snakemake(tmp_path, dataset, extractor, "--configfile", cfg)
    last = [line for line in p.stdout.splitlines() if line.startswith("diffrelay: run")][-1]
    assert last == f"diffrelay: run tiny done; results in {tmp_path / 'results' / 'tiny'}", p.stdout


# --- slow: one real tiny run, then reruns of parts of it -----------------------------------------
# --cores 3: one core for each job that can be ready at once (a segment, the reference statistics,
# sampling), so the scheduler starts sampling of checkpoint 40 in the same round as segment 2; the
# overlap test reads that order from the scheduler's log, never from clocks. So sampling need not be long:
# 32 images (more than the 24 of the changed-count test) in 4 steps.
SLOW = {"train": {"total_steps": 80, "segment_steps": 40, "batch_size": 16, "log_every": 10},
        "sample": {"num_images": 32, "steps": 4, "batch_size": 16}}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Run the whole workflow once on a tiny config with --cores 2; returns (folder, config, output)."""
    work = tmp_path_factory.mktemp("workflow")
    d = deep_merge(deep_merge(TINY, SLOW), {"run": {"results": str(work / "results"),
                                                    "resources": str(work / "resources")}})
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(d, sort_keys=False))
    p = snakemake(work, "--configfile", cfg, cores=3)
    return work, cfg, p.stdout + p.stderr


def run_folder(work):
    return work / "results" / "tiny"


def mtimes(folder: Path, pattern: str) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob(pattern))}


@pytest.mark.slow
def test_tiny_run_writes_the_report(tiny_run):
    work, _, out = tiny_run
    report = run_folder(work) / "report"
    for name in ("metrics.csv", "fid.png", "loss.png", "best.json", "best_grid.png"):
        assert (report / name).stat().st_size > 0, name
    assert finished_rules(out)["sample_snapshot"] == 2 and finished_rules(out)["compute_fid"] == 2
    segments = [json.loads(p.read_text())["scores"] for p in sorted((run_folder(work) / "metrics/segments").glob("*.json"))]
    assert [[Path(s).name for s in seg] for seg in segments] == [["step_0000040.json"], ["step_0000080.json"]]


@pytest.mark.slow
def test_every_job_log_starts_with_the_exact_command(tiny_run):
    work, _, out = tiny_run
    # Snakemake prints each shell command; the part after `set -x; ` is what the job ran.
    printed = {c.strip() for c in re.findall(r"Shell command: .*?set -x; (.*)", out)}
    logs = list((work / "logs").rglob("*.log"))
    assert len(logs) == 12  # fetch, prepare, reference, 2 train, 2 sample, 2 fid, 2 collect, report
    for log in logs:
        first = log.read_text().splitlines()[0]
        assert first.startswith(("diffrelay ", "torchrun ")), (log, first)
        assert first in printed, (log, first)


@pytest.mark.slow
def test_console_holds_no_warnings_of_our_making(tiny_run):
    work, _, out = tiny_run
    assert "never awaited" not in out and "Traceback" not in out
    for log in (work / "logs" / "tiny" / "train_segment").glob("*.log"):
        assert "Warning" not in log.read_text(), log  # e.g. DDP's "grad strides do not match bucket view"


def job_events(output: str) -> list[tuple[str, int, str]]:
    """("start", jobid, the rule's message) and ("end", jobid, rule) in the order Snakemake's scheduler
    reported them."""
    return [("start", int(m.group(1)), m.group(2)) if m.group(1) else ("end", int(m.group(3)), m.group(4))
            for m in re.finditer(r"^Job (\d+): (.*)$|^Finished jobid: (\d+) \(Rule: (\w+)\)", output, re.M)]


@pytest.mark.slow
def test_sampling_of_a_checkpoint_overlaps_training_of_the_next_segment(tiny_run):
    """Proven from the scheduler's own order of events, not from clocks racing: sampling of checkpoint 40 is
    started before segment (40, 80] is reported finished, and that segment before the sampling is."""
    _, _, out = tiny_run
    events = job_events(out)
    position = {(kind, jobid): i for i, (kind, jobid, _) in enumerate(events)}

    def job(message):
        return next(j for kind, j, m in events if kind == "start" and m.startswith(message))

    train, samp = job("Training tiny up to step 80"), job("Sampling the step 0000040 images")
    assert position[("start", samp)] < position[("end", train)], events
    assert position[("start", train)] < position[("end", samp)], events


@pytest.mark.slow
def test_forced_fid_rescores_without_retraining_or_resampling(tiny_run):
    work, cfg, _ = tiny_run
    run = run_folder(work)
    before = mtimes(run, "checkpoints/*") | mtimes(run, "samples/*") | mtimes(run, "snapshots/*")
    fid_before = mtimes(run, "metrics/fid/*.json")
    p = snakemake(work, "--configfile", cfg, "--forcerun", "compute_fid")
    ran = finished_rules(p.stdout + p.stderr)
    assert ran["compute_fid"] == 2 and not ran["train_segment"] and not ran["sample_snapshot"], ran
    assert mtimes(run, "checkpoints/*") | mtimes(run, "samples/*") | mtimes(run, "snapshots/*") == before
    assert all(mtimes(run, "metrics/fid/*.json")[k] > v for k, v in fid_before.items())


@pytest.mark.slow
def test_deleted_sample_folder_is_regenerated_alone(tiny_run):
    work, cfg, _ = tiny_run
    run = run_folder(work)
    shutil.rmtree(run / "samples/step_0000040")
    kept = mtimes(run, "samples/step_0000080")
    p = snakemake(work, "--configfile", cfg)
    ran = finished_rules(p.stdout + p.stderr)
    assert ran["sample_snapshot"] == 1 and ran["compute_fid"] == 1 and not ran["train_segment"], ran
    assert (run / "samples/step_0000040/grid.png").is_file()
    assert mtimes(run, "samples/step_0000080") == kept


@pytest.mark.slow
def test_changed_sample_count_resamples_and_rescores_but_does_not_retrain(tiny_run):
    work, cfg, _ = tiny_run
    run = run_folder(work)
    checkpoints = mtimes(run, "checkpoints/*")
    extra = work / "fewer-images.yaml"
    extra.write_text("sample:\n  num_images: 24\n")  # an extra --configfile, as the override error advises
    p = snakemake(work, "--configfile", cfg, extra)
    ran = finished_rules(p.stdout + p.stderr)
    assert ran["sample_snapshot"] == 2 and ran["compute_fid"] == 2 and not ran["train_segment"], ran
    assert mtimes(run, "checkpoints/*") == checkpoints
    for step in ("0000040", "0000080"):
        assert json.loads((run / f"metrics/fid/step_{step}.json").read_text())["num_images"] == 24


@pytest.mark.slow
def test_changed_model_setting_is_refused_for_the_run_but_changed_thread_count_plans_nothing(tiny_run):
    work, cfg, _ = tiny_run
    wider = work / "wider.yaml"
    wider.write_text("model:\n  channels: 12\n")
    before = mtimes(run_folder(work), "checkpoints/*")
    p = snakemake(work, "-n", "--configfile", cfg, wider, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("diffrelay: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stdout + p.stderr
    assert "model.channels=12" in errors[0] and str(run_folder(work)) in errors[0] and "new run.name" in errors[0]
    assert mtimes(run_folder(work), "checkpoints/*") == before
    # With a new run name the same settings plan a fresh run beside the old one.
    (work / "wider-run.yaml").write_text("run:\n  name: wider\nmodel:\n  channels: 12\n")
    p = snakemake(work, "-n", "--configfile", cfg, work / "wider-run.yaml")
    assert job_counts(p.stdout)["train_segment"] == 2
    threads = work / "threads.yaml"
    threads.write_text("train:\n  threads: 2\nsample:\n  threads: 2\n")
    p = snakemake(work, "-n", "--configfile", cfg, threads)
    out = p.stdout + p.stderr
    assert "Nothing to be done" in out or "train_segment" not in job_counts(out), out


@pytest.mark.slow
def test_snakemake_report_holds_every_grid_and_the_training_segments(tiny_run):
    work, cfg, _ = tiny_run
    snakemake(work, "--configfile", cfg, "--report", work / "report.zip")
    with zipfile.ZipFile(work / "report.zip") as z:
        names = z.namelist()
        html = z.read(next(n for n in names if n.endswith("report.html"))).decode()
    assert sorted(Path(n).name for n in names if n.endswith(".png")) == \
        ["best_grid.png", "fid.png", "grid.png", "grid.png", "loss.png"]  # one grid per evaluated step
    for rule in ("train_segment", "sample_snapshot", "compute_fid", "collect_segment", "build_report"):
        assert f'"rule": "{rule}"' in html, rule
    assert '"sourcerule": "train_segment", "targetrule": "sample_snapshot"' in html


@pytest.mark.slow
def test_cpu_recipe_for_your_own_images_runs_on_a_tiny_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(40):
        folder = tmp_path / "data" / "my-images" / ("cats", "dogs")[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype="uint8")).save(folder / f"{i}.png")
    short = tmp_path / "short.yaml"  # the recipe as shipped, only shorter
    short.write_text("train: {total_steps: 4, segment_steps: 2, recovery_every: 0, warmup_steps: 1}\n"
                     "sample: {num_images: 16, steps: 4, batch_size: 16}\n")
    snakemake(tmp_path, "--configfile", REPO / "config/config.yaml", REPO / "config/examples/own-images-cpu.yaml",
              short)
    run = tmp_path / "results" / "my-images-cpu"
    info = json.loads((run / "dataset" / "dataset.json").read_text())
    assert info["count"] == 40 and info["class_names"] == ["cats", "dogs"]
    assert (run / "report" / "metrics.csv").read_text().count("\n") == 3  # header + steps 2 and 4
    # An image edited in place in the finished run's folder: Snakemake sees it (not "Nothing to be done"),
    # prepare says what changed, and the run refuses in one line to go on with checkpoints of the old images.
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype="uint8")).save(tmp_path / "data/my-images/dogs/3.png")
    p = snakemake(tmp_path, "--configfile", REPO / "config/config.yaml", REPO / "config/examples/own-images-cpu.yaml",
                  short, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and finished_rules(out)["prepare_dataset"] == 1, out
    assert "changed since my-images-cpu was trained on it: image dogs/3.png changed" in \
        (tmp_path / "logs/my-images-cpu/prepare_dataset/prepare_dataset.log").read_text()
    refused = [line for log in (tmp_path / "logs/my-images-cpu/train_segment").glob("*.log")
               for line in log.read_text().splitlines() if line.startswith("diffrelay: error:")]
    assert len(refused) == 1 and "or captions edited: image dogs/3.png changed); restore them" in refused[0], refused


@pytest.mark.slow
def test_rerun_training_jobs_keep_their_checkpoints(tiny_run):
    """Snakemake deletes a job's outputs before it reruns it (after a rule's code changes, or when the
    dataset is rebuilt). A segment's output is a small record, so its checkpoint survives the rerun."""
    work, cfg, _ = tiny_run
    run = run_folder(work)
    before = {p.relative_to(run): p.read_bytes() for p in run.glob("checkpoints/*/*")}
    p = snakemake(work, "--configfile", cfg, "--forcerun", "train_segment", "--until", "train_segment")
    out = p.stdout + p.stderr
    assert finished_rules(out)["train_segment"] == 2, out
    assert {p.relative_to(run): p.read_bytes() for p in run.glob("checkpoints/*/*")} == before
    logs = sorted((work / "logs" / "tiny" / "train_segment").glob("*.log"))
    assert all("already exists; nothing to do" in log.read_text() for log in logs)
    assert json.loads((run / "trained" / "step_0000080.json").read_text())["checkpoint"].endswith("step_0000080")


@pytest.mark.slow
def test_custom_network_in_the_working_directory_trains_samples_and_sweeps_guidance(tmp_path):
    """A network file beside the config (not installed, not on PYTHONPATH) trains two segments, and every
    checkpoint is sampled and scored once per guidance scale; adding a scale plans only its own jobs."""
    shutil.copy(REPO / "tests" / "fixtures" / "diffrelay_test_net.py", tmp_path / "my_net.py")
    d = deep_merge(TINY, {"run": {"results": str(tmp_path / "results"), "resources": str(tmp_path / "resources")},
                          "model": {"arch": "my_net:build", "kwargs": {"width": 8}},
                          "train": {"label_dropout": 0.2}, "sample": {"guidance": [1.0, 2.0]}})
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(d, sort_keys=False))
    out = snakemake(tmp_path, "--configfile", cfg)
    ran = finished_rules(out.stdout + out.stderr)
    assert ran["train_segment"] == 2 and ran["sample_snapshot"] == 4 and ran["compute_fid"] == 4
    report = run_folder(tmp_path) / "report"

    with open(report / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    per_step = collections.Counter(r["step"] for r in rows)
    assert per_step == {"3": 2, "6": 2}
    assert sorted({float(r["guidance"]) for r in rows}) == [1.0, 2.0]
    best = json.loads((report / "best.json").read_text())
    assert best["guidance"] in (1.0, 2.0) and best["step"] in (3, 6)
    grids = sorted(p.name for p in (run_folder(tmp_path) / "samples").iterdir())
    assert grids == ["step_0000003", "step_0000003_g2", "step_0000006", "step_0000006_g2"]

    d["sample"]["guidance"] = [1.0, 2.0, 3.0]
    cfg.write_text(yaml.safe_dump(d, sort_keys=False))
    plan = job_counts(snakemake(tmp_path, "-n", "--configfile", cfg).stdout)
    assert plan.get("sample_snapshot") == 2 and plan.get("compute_fid") == 2 and "train_segment" not in plan


@pytest.mark.slow
def test_flow_recipe_trains_samples_with_the_sde_and_the_guidance_interval_and_reports(tmp_path):
    """config/examples/flow-cpu.yaml as shipped, only shorter: flow training in two segments, SiT's SDE
    sampler at every checkpoint, one job per guidance scale, the interval only where guidance is on."""
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump({
        "run": {"results": str(tmp_path / "results"), "resources": str(tmp_path / "resources")},
        "data": {"count": 200}, "train": {"total_steps": 4, "segment_steps": 2, "warmup_steps": 1, "log_every": 1},
        "sample": {"num_images": 16, "steps": 4, "batch_size": 16}, "fid": {"batch_size": 16, "ref_images": 0}}))
    out = snakemake(tmp_path, "--configfile", REPO / "config/config.yaml", REPO / "config/examples/flow-cpu.yaml",
                    short)
    ran = finished_rules(out.stdout + out.stderr)
    assert ran["train_segment"] == 2 and ran["sample_snapshot"] == 4 and ran["compute_fid"] == 4, ran
    run = tmp_path / "results" / "flow-cpu"
    commands = {p.name: p.read_text().splitlines()[0] for p in (tmp_path / "logs/flow-cpu/sample_snapshot").glob("*.log")}
    assert all("--solver sde" in c for c in commands.values()) and len(commands) == 4
    assert ["--guidance-interval 0.0 0.7" in c for _, c in sorted(commands.items())] == [False, True, False, True]
    manifest = json.loads((run / "samples" / "step_0000004_g1.8" / "manifest.json").read_text())
    assert manifest["solver"] == "sde" and manifest["guidance_interval"] == [0.0, 0.7]
    meta = json.loads((run / "checkpoints" / "step_0000004" / "meta.json").read_text())
    assert meta["config"]["model"]["objective"] == "flow"
    with open(run / "report" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["step"], float(r["guidance"])) for r in rows) == [("2", 1.0), ("2", 1.8), ("4", 1.0), ("4", 1.8)]


# --- the evaluation protocol: extractors, seed sets, the second pass ------------------------------
def test_each_extractor_gets_its_own_fetch_and_reference_and_the_second_pass_is_planned(tmp_path, write_config):
    cfg = write_config({"fid": {"extractors": ["random", "dinov2"], "final": {"best": 1, "num_images": 16}},
                        "sample": {"seed_sets": 2}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg)
    plan = job_counts(p.stdout)
    assert plan["fetch_extractor"] == 2 and plan["compute_reference"] == 2 and plan["select_best"] == 1, plan
    assert "resources/extractors/dinov2-vitl14.pt" in p.stdout and "fid/reference_dinov2-vitl14.npz" in p.stdout
    assert "fetch-extractor --extractor dinov2-vitl14" in p.stdout


def test_a_reference_file_for_one_extractor_replaces_only_its_statistics(tmp_path, write_config):
    ref = tmp_path / "cifar10-32x32.npz"
    np.savez(ref, mu=np.zeros(2048), sigma=np.eye(2048))
    cfg = write_config({"fid": {"extractors": ["random", "inception"], "reference": {"inception": str(ref)}}})
    p = snakemake(tmp_path, "-n", "--configfile", cfg)
    assert job_counts(p.stdout)["compute_reference"] == 1 and "reference_random-seed0.npz" in p.stdout
    assert "reference_inception" not in p.stdout


@pytest.mark.slow
def test_seed_sets_two_extractors_and_a_second_pass_run_end_to_end(tmp_path, write_config):
    """Every checkpoint scored over 2 seed sets with 2 extractors (images decoded once per job); the best
    one sampled and scored again with more images once all first-pass scores exist; a rerun does nothing,
    and a larger fid.final.best plans only the new second-pass jobs."""
    from diffrelay.evaluation import extractor

    extractor.build_random(tmp_path / "other.pt", seed=7)  # what `diffrelay fetch-extractor --seed 7` writes
    over = {"sample": {"seed_sets": 2}, "fid": {"extractors": ["random", str(tmp_path / "other.pt")],
                                                 "final": {"best": 1, "num_images": 12}}}
    cfg = write_config(over)
    out = snakemake(tmp_path, "--configfile", cfg)
    ran = finished_rules(out.stdout + out.stderr)
    assert ran["train_segment"] == 2 and ran["select_best"] == 1
    assert ran["sample_snapshot"] == 2 * 2 + 2 and ran["compute_fid"] == 2 * 2 + 2  # + the 2 seed sets of the best
    run = run_folder(tmp_path)
    [pick] = json.loads((run / "metrics/final/selected.json").read_text())["selected"]
    best_name = f"step_{pick['step']:07d}_n12"
    assert (run / "samples" / best_name).is_dir() and (run / "samples" / f"{best_name}_s1").is_dir()
    assert len(list((run / "samples" / f"{best_name}_s1").glob("0*.png"))) == 12
    rec = json.loads((run / "metrics/fid" / f"{best_name}_s1.json").read_text())
    assert [s["metric"] for s in rec["scores"]] == ["FD-12 (random features) [random-seed0.pt]",
                                                    "FD-12 (random features) [other.pt]"]
    # Seed set 1 starts where set 0 ends: its images are not set 0's.
    assert (run / "samples/step_0000006/000000.png").read_bytes() != (run / "samples/step_0000006_s1/000000.png").read_bytes()
    best = json.loads((run / "report/best.json").read_text())
    assert best["metric"] == "FD-12 (random features) [random-seed0.pt]" and best["seed_sets"] == 2
    assert "Nothing to be done" in snakemake(tmp_path, "-n", "--configfile", cfg).stdout

    over["fid"]["final"]["best"] = 2
    again = snakemake(tmp_path, "--configfile", write_config(over))
    ran = finished_rules(again.stdout + again.stderr)
    assert "train_segment" not in ran and "prepare_dataset" not in ran and ran["select_best"] == 1
    assert ran["sample_snapshot"] == 2 and ran["compute_fid"] == 2  # the new pick's 2 seed sets only
    assert len(list((run / "metrics/fid").glob("*_n12*.json"))) == 4


@pytest.mark.slow
def test_post_hoc_ema_widths_are_reconstructed_sampled_and_scored_after_the_last_segment(tmp_path, write_config):
    cfg = write_config({"train": {"phema": {"every": 3}}, "sample": {"phema": [0.08]}})
    out = snakemake(tmp_path, "--configfile", cfg)
    ran = finished_rules(out.stdout + out.stderr)
    assert ran["reconstruct_phema"] == 1 and ran["sample_snapshot"] == 3 and ran["compute_fid"] == 3
    run = run_folder(tmp_path)
    assert (run / "snapshots/phema/step_0000006_ema0.08.safetensors").is_file()
    manifest = json.loads((run / "samples/step_0000006_ema0.08/manifest.json").read_text())
    assert manifest["snapshot"].endswith("snapshots/phema/step_0000006_ema0.08.safetensors")
    rows = [r.split(",") for r in (run / "report/metrics.csv").read_text().splitlines()]
    header = rows[0]
    assert [r[header.index("phema")] for r in rows[1:] if r[0] == "6"] == ["0.08", ""]
    # The reconstruction's images differ from the training EMA's at the same step and seeds.
    assert (run / "samples/step_0000006_ema0.08/000000.png").read_bytes() != \
        (run / "samples/step_0000006/000000.png").read_bytes()
    assert "Nothing to be done" in snakemake(tmp_path, "-n", "--configfile", cfg).stdout


def test_scoring_jobs_get_run_device_and_multi_node_ports_spread_over_20000(tmp_path, write_config):
    """run.device: cpu on a GPU machine keeps reference and FID jobs on the CPU (they used to pile onto GPU 0);
    the rendezvous port of a multi-node job spreads over 20000 values, not 1000."""
    p = snakemake(tmp_path, "-n", "-p", "--configfile", write_config())
    ref = re.search(r"diffrelay fid-ref .*", p.stdout).group(0)
    assert "--device cpu" in ref
    assert "--device {params.device:q}" in (REPO / "workflow/rules/fid.smk").read_text()
    p = snakemake(tmp_path, "-n", "-p", "--configfile", write_config({"train": {"nnodes": 2}}, name="mn.yaml"))
    assert "port=$((30000 + SLURM_JOB_ID % 20000))" in p.stdout


def test_gpu_pool_auto_keeps_uuids_and_explicit_ids_must_be_inherited(tmp_path, write_config):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111,GPU-bbbb-2222"}
    auto = write_config({"run": {"gpus": "auto", "device": "cuda"}}, name="auto.yaml")
    p = run_cli("snakemake", "--snakefile", SNAKEFILE, "--directory", tmp_path, "--cores", 2, "-n", "-p",
                "--configfile", auto, env=env)
    assert "--pool GPU-aaaa-1111 --count 1" in p.stdout and "--pool GPU-bbbb-2222 --count 1" in p.stdout
    explicit = write_config({"run": {"gpus": [0, 1], "device": "cuda"}}, name="explicit.yaml")
    p = run_cli("snakemake", "--snakefile", SNAKEFILE, "--directory", tmp_path, "--cores", 2, "-n",
                "--configfile", explicit, env={**os.environ, "CUDA_VISIBLE_DEVICES": "2,3"}, check=False)
    assert p.returncode != 0 and "id(s) 0,1 are not among the GPUs this job was given" in p.stdout + p.stderr
    # One GPU named twice would be two slots of one GPU (and with-gpus would wait forever for its second lock).
    p = run_cli("snakemake", "--snakefile", SNAKEFILE, "--directory", tmp_path, "--cores", 2, "-n",
                "--configfile", auto, env={**env, "CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111,GPU-aaaa-1111"}, check=False)
    errors = [x for x in p.stderr.splitlines() if x.startswith("diffrelay: error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "run.gpus=auto: CUDA_VISIBLE_DEVICES=GPU-aaaa-1111,GPU-aaaa-1111 names GPU GPU-aaaa-1111 twice" in errors[0]
