"""A run's configuration: one package for one concern, a module each.

- `schema.py` and `schema.yaml`: the JSON Schema, loading (`load`, `validate`), the read-only `Config`.
- `rules.py`: rules across keys, in the order they are reported; each concern's own checks are called from here
  (sampling.checks, evaluation.protocol, training.settings, training.profiles, data.captions, runtime.gpus,
  nets.checks), so a rule that needs a concern's details lives in that concern's package. `model.pretrained` and
  `train.lora` come first, from `schema.validate` (pretrained.expand; the LoRA rules in pretrained/lora.py).
- `text.py`: the rules of text runs (captions, encoders, prompt files, CLIP score).
- `paths.py`: the keys that name files and folders; `run_dir`.
- `identity.py`: what changes the weights (`trajectory`), its hash, and whether a file belongs to a run.
- `segments.py`: where segments end and which snapshots a segment writes.
- `preflight.py`: checks against the disk before any job (the dataset, the run folder, latents, trackers).
- `inputs.py`: the dataset's folders and the image counts the later stages need (preflight calls it).
- `report.py`: `diffrelay validate`, the report of what a run will do; `memory.py`: its memory lines;
  `netcache.py`: what building the network told them, kept per input so it is built once.

The names below are the package's door: `from diffrelay import config; config.load(path)`.

Imports: every library package (it is the front: its rules call each concern's checks) and the YAML reader; no
torch at module level outside memory.py, so the Snakefile can use it. No library package imports it: configuration
flows in as arguments, and only a stage's entry module (one with `main`) reads it.
"""

from diffrelay.config.identity import (applicable, applicable_model, check_same_files, data_hash, difference,
                                       first_difference, is_same_run, lookup, run_hash, section_hash, trajectory,
                                       trajectory_hash)
from diffrelay.config.paths import run_dir
from diffrelay.config.pipeline import pipeline_config, sample_config
from diffrelay.config.schema import Config, load, load_schema, merged, non_finite, read_yaml, validate
from diffrelay.config.segments import segment_ends, snapshot_steps

__all__ = ["Config", "applicable", "applicable_model", "check_same_files", "data_hash", "difference",
           "first_difference", "is_same_run", "load", "load_schema", "merged", "lookup", "non_finite", "pipeline_config", "sample_config", "read_yaml", "run_dir",
           "run_hash", "section_hash", "segment_ends", "snapshot_steps", "trajectory", "trajectory_hash", "validate"]
