"""`diffrelay <stage>`: one subcommand per workflow stage. Stage modules are imported only when run.

Examples:
  diffrelay prepare --config config/config.yaml
  torchrun --standalone --nproc-per-node 2 -m diffrelay train --config config/config.yaml --until-step 400
  diffrelay sample --config config/config.yaml --snapshot results/demo/snapshots/step_0000400.safetensors \\
      --out results/demo/samples/step_0000400
  diffrelay fid --images results/demo/samples/step_0000400 --ref results/demo/fid/reference_random-seed0.npz \\
      --extractor resources/extractors/random-seed0.pt --out results/demo/metrics/fid/step_0000400.json
"""

import argparse
import importlib
import math
import sys

from diffrelay import __version__
from diffrelay.errors import UserError


def _true_false(text: str) -> bool:
    """A boolean flag's value as YAML and Python write it (the workflow passes Python's True/False)."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: use true or false")
    return text.lower() == "true"

def _config(p, required=True):
    p.add_argument("--config", action="append", required=required, metavar="YAML",
                   help="run config; repeat to layer files (later ones win)")


def _size(text: str) -> tuple[int, int]:
    """An image size as the workflow's folder names write it: WIDTHxHEIGHT in pixels, e.g. 1216x832, each side in
    the bounds of sample.sizes and prompt files (data.prompts.SIDES: one rule for every way a size comes in)."""
    from diffrelay.data.prompts import SIDES, side_problem  # plain Python: no torch

    w, x, h = text.lower().partition("x")
    if not (x and w.isdigit() and h.isdigit()) or side_problem(int(w), int(h)):
        raise argparse.ArgumentTypeError(f"{text!r}: use WIDTHxHEIGHT in pixels, each side from {SIDES[0]} to "
                                         f"{SIDES[1]}, e.g. 1216x832")
    return int(w), int(h)


def _side(text: str) -> int:
    """An image side in pixels, in the bounds of _size's."""
    from diffrelay.data.prompts import SIDES, side_problem

    if not text.isdigit() or side_problem(int(text)):
        raise argparse.ArgumentTypeError(f"{text!r}: use the image side in pixels, from {SIDES[0]} to {SIDES[1]}, "
                                         "e.g. 1024")
    return int(text)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be 0 or more")
    return value


def _metrics(text: str) -> list[str]:
    from diffrelay.evaluation.protocol import METRICS

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r}: not a metric; use some of {', '.join(METRICS)}")
    return list(dict.fromkeys(names))


def _positive(unit: str):
    """An argparse type: a finite number of `unit` above 0 (nan and inf would mean no limit at all)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text}: not a number of {unit}") from e
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number of {unit} above 0")
        return value
    return parse


_minutes, _gib = _positive("minutes"), _positive("GiB")  # time limits; GPU memory


def _card(text: str) -> float:
    """--gpu-memory: a card's memory as its maker writes it, 24GB, 24G, 24GiB or 24, read as GiB: a "24 GB" RTX 4090
    has 24,564 MiB, an "80 GB" H100 81,559 MiB."""
    number = text.strip()
    for unit in ("GiB", "GB", "G"):
        if number.upper().endswith(unit.upper()):
            number = number[: -len(unit)].strip()
            break
    return _gib(number)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffrelay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"diffrelay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="STAGE")

    p = sub.add_parser("validate", help="check a config and print it with defaults filled in")
    _config(p)
    p.add_argument("--gpu-memory-gib", "--gpu-memory", type=_card, metavar="GIB", help="compare the training memory "
                   "estimate with GPUs of this many GiB instead of this machine's (planning on a CPU machine: 80, "
                   "24GB) and list the train.optimizer choices that fit")
    p.set_defaults(module="diffrelay.config.report")

    p = sub.add_parser("prepare", help="build the dataset folder (images.npy, labels.npy, dataset.json)")
    _config(p)
    p.add_argument("--out", help="dataset folder [default: <results>/<run>/dataset]")
    p.add_argument("--workers", type=_non_negative, help="decoding processes; 0 = one per core [default: data.workers]")
    p.add_argument("--relaunch", metavar="COMMAND", help="a latent run: start prepare again under this launcher "
                                                         "(the workflow's `diffrelay launch ... -m diffrelay`)")
    p.set_defaults(module="diffrelay.data.prepare")

    p = sub.add_parser("train", help="train one segment: resume, run to --until-step, checkpoint, exit")
    _config(p)
    p.add_argument("--until-step", type=int, help="stop after this step [default: train.total_steps]")
    p.add_argument("--init", help="checkpoint folder to start from [default: newest in the run folder]")
    p.add_argument("--dataset", help="dataset folder [default: <results>/<run>/dataset]")
    p.add_argument("--trace", help="append the dataset indices of every step to this JSONL file (tests)")
    p.add_argument("--record", help="when the segment's checkpoint is complete, write this JSON record of it "
                                    "(the workflow's output for the segment)")
    p.set_defaults(module="diffrelay.training.train")

    p = sub.add_parser("sample", help="generate PNGs from a snapshot; no dataset, no process group needed")
    _config(p, required=False)
    p.add_argument("--snapshot", required=True, help="snapshot file (.safetensors), or a diffusers pipeline folder "
                   "(model_index.json) to sample as it came, with no run")
    p.add_argument("--out", required=True, help="output folder for PNGs, grid.png and manifest.json")
    p.add_argument("--resolution", type=_side, help="a pipeline folder: the image side in pixels [default: "
                   "data.resolution of --config]")
    p.add_argument("--size", type=_size, metavar="WxH", help="the image size in pixels, width x height, e.g. "
                   "1216x832 (the workflow passes one of sample.sizes) [default: the snapshot's square, "
                   "data.resolution]")
    p.add_argument("--num-images", type=int, help="how many images (sample.num_images)")
    p.add_argument("--first-seed", type=int, help="image i gets seed first-seed + i (sample.first_seed)")
    p.add_argument("--steps", type=int, help="sampler steps; heun makes 2 x steps - 1 network evaluations "
                   "(sample.steps)")
    p.add_argument("--solver", choices=["heun", "euler", "sde", "ddpm", "ddim"],
                   help="sde: model.objective flow only; ddpm, ddim: model.objective ddpm only")
    p.add_argument("--scheduler", metavar="CLASS", help="a diffusers scheduler instead of --solver, e.g. "
                   "DPMSolverMultistepScheduler, UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler "
                   "(sample.scheduler)")
    p.add_argument("--scheduler-kwargs", metavar="JSON", help="its other config keys as a JSON object, e.g. "
                   "'{\"use_karras_sigmas\": true}' (sample.scheduler_kwargs)")
    p.add_argument("--batch-size", type=int, help="images per forward pass per process; the pixels do not "
                   "depend on it (sample.batch_size)")
    p.add_argument("--weights", choices=["ema", "raw"], help="the EMA of the weights or the weights as trained "
                   "(sample.weights)")
    p.add_argument("--ema-decay", type=float, help="which of train.ema_decays's EMAs (sample.ema_decay); default the first")
    p.add_argument("--class-labels", help="balanced or a class index")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: autocast the network's forward "
                   "(sample.precision)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, help="sample.tf32: TF32 matmuls on CUDA")
    p.add_argument("--quantize-base", choices=["int8", "fp8", "nf4"], help="a LoRA run's frozen base quantized "
                   "as train.lora.quantize_base holds it (sample.quantize_base) [default: unquantized]")
    p.add_argument("--threads", type=int, help="CPU threads of this process (sample.threads)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale; 1 = off")
    p.add_argument("--true-cfg-scale", type=float, help="FLUX.1: FluxPipeline's true_cfg_scale for prompts with a "
                   "negative prompt (sample.true_cfg_scale); 1 = off")
    p.add_argument("--prompts", metavar="FILE", help="a text run's prompt file (sample.prompts): one prompt a line, or "
                   "YAML/JSONL entries with prompt, negative_prompt, seed, guidance, steps, num_images, label")
    p.add_argument("--held-out-captions", action="store_true", help="a text run: sample one image per held-out "
                   "caption (up to --num-images) even where the config names sample.prompts (the workflow's _ph)")
    p.add_argument("--prompts-sha256", metavar="HEX", help="the prompt file's sha256 when the workflow planned the job: "
                   "refused if the file changed since")
    p.add_argument("--guide", metavar="SNAPSHOT", help="autoguidance: this snapshot guides instead of the null class "
                   "(sample.guide)")
    p.add_argument("--guidance-interval", type=float, nargs=2, metavar=("LO", "HI"),
                   help="guide only at noise levels LO <= sigma <= HI (sample.guidance_interval)")
    # sample.edm: EDM's schedule and churn (docs/config.md); a flag overrides the config's value
    for key in ("sigma_min", "sigma_max", "rho", "S_churn", "S_min", "S_max", "S_noise"):
        p.add_argument("--" + key.lower().replace("_", "-"), type=float, help=f"sample.edm.{key}")
    p.add_argument("--flow-shift", type=float, help="sample.flow.shift")
    p.add_argument("--flow-last-step", type=float, help="sample.flow.last_step")
    p.add_argument("--flow-guided-channels", type=int, help="sample.flow.guided_channels (SiT's forward_with_cfg: 3)")
    p.add_argument("--ddpm-eta", type=float, help="sample.ddpm.eta (solver ddim)")
    p.add_argument("--ddpm-guided-channels", type=int, help="sample.ddpm.guided_channels (DiT's sample.py: 3)")
    p.add_argument("--ddpm-clip-denoised", type=_true_false, help="sample.ddpm.clip_denoised: true or false")
    p.add_argument("--npz", type=_true_false, help="also write samples.npz (ADM evaluator's format): true or false "
                   "[default: sample.npz]")
    p.set_defaults(module="diffrelay.sampling.sample")

    p = sub.add_parser("phema", help="post-hoc EMA: a snapshot with the EMA of any width, from train.phema's files")
    p.add_argument("--run-dir", required=True, help="results/<run>, holding phema/step_XXXXXXX.safetensors")
    p.add_argument("--sigma-rel", type=float, required=True, help="width of the EMA to build, e.g. 0.08")
    p.add_argument("--until-step", type=int, help="the step to build it at (a stored one) [default: the last stored]")
    p.add_argument("--out", help="snapshot file to write [default: <run-dir>/snapshots/phema/"
                                 "step_XXXXXXX_ema<sigma>.safetensors]")
    p.set_defaults(module="diffrelay.training.phema")

    p = sub.add_parser("import", help="a published checkpoint (plain state dict) as a snapshot to sample and score")
    _config(p)
    p.add_argument("--checkpoint", required=True, help="the file: .pt/.pth (torch zip, read weights_only) or "
                                                        ".safetensors; pickles (.pkl) are refused")
    p.add_argument("--out", required=True, help="snapshot to write (.safetensors); name it in sample.snapshot")
    p.add_argument("--layout", help="parameter names of the file: dit (DiT's and SiT's), diffrelay "
                                    "[default: model.arch's published layout]")
    p.add_argument("--step", type=_non_negative, default=0, help="the step the snapshot is labelled with [0]")
    p.set_defaults(module="diffrelay.training.convert")

    p = sub.add_parser("import-dataset", help="the data: section of a kohya sd-scripts dataset config (.toml) or a "
                       "SimpleTuner multidatabackend.json, as YAML; one line for each key it cannot carry over")
    p.add_argument("config_file", help="kohya's dataset config ([general], [[datasets]], [[datasets.subsets]]), or "
                   "SimpleTuner's dataloader config (.json)")
    p.add_argument("--out", help="write the YAML to this new file (default: stdout)")
    p.set_defaults(module="diffrelay.data.kohya")

    p = sub.add_parser("export", help="a diffusers pipeline folder with a model.pretrained run's weights "
                                      "(DiffusionPipeline.from_pretrained loads it)")
    _config(p)
    p.add_argument("--snapshot", required=True, help="the snapshot whose weights go in (snapshots/step_X.safetensors"
                                                      ", or a post-hoc EMA one)")
    p.add_argument("--out", required=True, help="the pipeline folder to write (new, or an earlier export's)")
    p.add_argument("--weights", choices=["ema", "raw"], help="the snapshot's EMA or raw weights [default: the ones "
                   "the run samples and scores, sample.weights of --config]")
    p.add_argument("--ema-decay", type=float, help="which of train.ema_decays's EMAs [default: sample.ema_decay's "
                   "(its first), else the first]")
    p.add_argument("--lora-format", choices=["diffusers", "comfyui"], default="diffusers",
                   help="diffusers: the pipeline folder, the adapter fused [default]; comfyui: a LoRA run's adapter "
                        "alone, one .safetensors file in kohya's keys (ComfyUI, sd-scripts; UNet pipelines: SD, "
                        "SDXL; and FLUX.1)")
    p.set_defaults(module="diffrelay.training.export")

    p = sub.add_parser("fetch-extractor", help="download or build a FID feature extractor (TorchScript)")
    p.add_argument("--extractor", required=True,
                   help="inception | random | dinov2 (= dinov2-vitl14) | dinov2-vits14 | dinov2-vitb14 | "
                        "dinov2-vitg14 | a TorchScript file")
    p.add_argument("--out", required=True, help="where the extractor file goes")
    p.add_argument("--seed", type=int, default=0, help="seed of the random extractor")
    p.add_argument("--weights", metavar="PTH", help="dinov2: the official dinov2_<model>_pretrain.pth, already "
                                                    "downloaded [default: that name next to --out, else download]")
    p.set_defaults(module="diffrelay.evaluation.fetch")

    p = sub.add_parser("fid-ref", help="reference statistics of a dataset (cached by fingerprint)")
    p.add_argument("--dataset", required=True, help="dataset folder made by `diffrelay prepare`")
    p.add_argument("--extractor", required=True, help="TorchScript extractor file")
    p.add_argument("--mode", default="clean", choices=["clean", "legacy_tensorflow"],
                   help="clean-fid's resize: clean (PIL) or legacy_tensorflow (ADM's, TF's) (fid.mode) [default: clean]")
    p.add_argument("--num", type=int, default=0, help="images to use; 0 = all")
    p.add_argument("--batch-size", type=int, default=64, help="images per extractor pass (fid.batch_size) [64]")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (fid.threads) [1]")
    p.add_argument("--cache-dir", help="reuse statistics cached here by (fingerprint, extractor, mode, device, count)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="run.device [default: auto]")
    p.add_argument("--out", required=True, help="statistics file (.npz)")
    p.set_defaults(module="diffrelay.evaluation.fid")

    p = sub.add_parser("fid", help="FID/KID of an image folder against reference statistics (in a clean subprocess)")
    p.add_argument("--images", required=True, help="folder of generated images")
    p.add_argument("--extractor", required=True, action="append",
                   help="a TorchScript extractor; repeat with --ref to score with several (images decoded once)")
    p.add_argument("--ref", required=True, action="append",
                   help="reference statistics made with the --extractor before it (`diffrelay fid-ref`, or a .npz "
                   "with mu and sigma)")
    p.add_argument("--mode", default="clean", choices=["clean", "legacy_tensorflow"],
                   help="clean-fid's resize: clean (PIL) or legacy_tensorflow (ADM's, TF's) (fid.mode) [default: clean]")
    p.add_argument("--batch-size", type=int, default=64, help="images per extractor pass (fid.batch_size) [64]")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (fid.threads) [1]")
    p.add_argument("--timeout-minutes", type=_minutes, default=60, help="kill the scoring child after this long")
    p.add_argument("--in-process", action="store_true", help="compute here instead of in a fresh subprocess")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="run.device [default: auto]")
    p.add_argument("--metrics", type=_metrics, help="fid.metrics, comma-separated (fid,sfid,is,kid,precision,recall,"
                   "fd_dinov2); unset: each extractor's distance, KID and precision/recall where the reference allows")
    p.add_argument("--cache-dir", help="cache of the features of ADM reference batches' images")
    p.add_argument("--clip-model", metavar="DIR", help="also the CLIP score of the images and their prompts (a text "
                   "run's NNNNNN.txt sidecars) with this local CLIP folder (fid.clip_model)")
    p.add_argument("--pick-model", metavar="DIR", help="also the PickScore of the images and their prompts with this "
                   "local PickScore (CLIPModel) folder (fid.pick_model)")
    p.add_argument("--classifier", metavar="DIR", help="also class_accuracy: the share of images this local image "
                   "classifier reads as the class or prompt label they were sampled for (fid.classifier)")
    p.add_argument("--prompts", metavar="FILE", help="the prompt file a text run's images were sampled from: "
                   "class_accuracy's labels (its entries' label keys) [default: whole words of each image's prompt]")
    p.add_argument("--out", required=True, help="result JSON")
    p.set_defaults(module="diffrelay.evaluation.fid")

    p = sub.add_parser("val-loss", help="the held-out loss of a snapshot (fid.metrics val_loss), with fixed noise "
                       "and noise levels, outside any process group")
    _config(p)
    p.add_argument("--snapshot", required=True, help="snapshot file (.safetensors)")
    p.add_argument("--dataset", help="prepared dataset folder [default: the run's dataset/]")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--batch-size", type=int, help="images per forward pass [default: sample.batch_size]")
    p.add_argument("--threads", type=int, help="CPU threads [default: sample.threads]")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="[default: run.device]")
    p.set_defaults(module="diffrelay.sampling.val_loss")

    p = sub.add_parser("launch", help="torchrun that keeps exit status 75 (stopped, resumable), handles SIGUSR1 "
                                      "and reports failed ranks in one line; takes torchrun's options",
                       add_help=False)
    p.add_argument("torchrun", nargs=argparse.REMAINDER, help="torchrun options and program")
    p.set_defaults(module="diffrelay.runtime.distributed")

    p = sub.add_parser("demo-encoder", help="write the text-to-image demo's text encoder (a random CLIP text model "
                       "with the shapes captions' vocabulary, or with --captions every word of yours) into a folder")
    p.add_argument("--out", required=True, help="folder to write (transformers' save_pretrained layout)")
    p.add_argument("--captions", metavar="PATH", help="an image folder (data.path, captions as data.captions auto "
                   "reads them) or a .csv, .parquet or .jsonl caption table: every word of its captions one token")
    p.add_argument("--file-column", default="file_name", help="data.file_column of metadata.jsonl [file_name]")
    p.add_argument("--caption-column", default="text", help="data.caption_column of the table or metadata.jsonl "
                   "[text]")
    p.add_argument("--width", type=int, help="hidden size [default: 64; 128 with --captions]")
    p.add_argument("--seed", type=int, default=0, help="weights' seed [default: 0]")
    p.set_defaults(module="diffrelay.data.caption_encoder")

    p = sub.add_parser("collect", help="list the FID results of one training segment in a JSON file (workflow)")
    p.add_argument("--out", required=True, help="JSON file: {\"scores\": [...]}")
    p.add_argument("scores", nargs="*", help="FID result files")
    p.set_defaults(module="diffrelay.evaluation.report")

    p = sub.add_parser("select-best", help="the best first-pass evaluations of a run, for the second pass (workflow)")
    p.add_argument("--best", type=int, required=True, help="how many (step, guidance) evaluations to keep")
    p.add_argument("--out", required=True, help="JSON file: {\"selected\": [{step, guidance, score}, ...]}")
    p.add_argument("segments", nargs="+", help="the `diffrelay collect` files of the run's segments")
    p.set_defaults(module="diffrelay.evaluation.protocol")

    p = sub.add_parser("with-gpus", help="run a command on free GPU ids of a pool (one machine; flock slots)")
    p.add_argument("--pool", required=True, help="GPU ids to share, e.g. 0,1,2,3, or auto (all visible)")
    p.add_argument("--count", type=int, required=True, help="ids this command needs")
    p.add_argument("--lock-dir", default="resources/gpu-locks", help="one lock file per id; shared by all jobs")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(module="diffrelay.runtime.gpus")

    p = sub.add_parser("track", help="send the run's training log, scores, grids and config to the trackers of "
                       "track (W&B, MLflow) that they have not had yet; workflow and by hand")
    _config(p)
    p.add_argument("--step", type=int, help="the segment end this publish follows (recorded in --out)")
    p.add_argument("--out", help="JSON record of what was sent and what is pending, per tracker")
    p.add_argument("--log", help="write the output and the trackers' messages here; warnings go to stderr too")
    p.add_argument("--final", action="store_true", help="the run's last publish: say how many records are pending")
    p.add_argument("--wait-minutes", type=_minutes, default=10, help="wait this long for another track job's "
                   "lock [10]")
    p.set_defaults(module="diffrelay.tracking.publish")

    p = sub.add_parser("report", help="metrics.csv, fid.png, loss.png and best.json of a run")
    p.add_argument("--run-dir", required=True, help="results/<run>")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--evaluated", metavar="SNAPSHOT", help="the run trained nothing and evaluated this file "
                                                          "(sample.snapshot): no training log is read")
    from diffrelay.evaluation.columns import BETTER  # plain Python: which way each metric is better

    p.add_argument("--best-by", choices=list(BETTER), default="fid", help="fid.best_by: the lowest distance or loss "
                   f"({', '.join(k for k, v in BETTER.items() if v == 'lower')}) or the highest score "
                   f"({', '.join(k for k, v in BETTER.items() if v == 'higher')}) [default: fid]")
    p.add_argument("--best-size", type=_size, metavar="WxH", help="sample.sizes: the size whose results pick the best "
                   "checkpoint (the first of sample.sizes) [default: the data.resolution square's, else the first "
                   "size in the results]")
    p.set_defaults(module="diffrelay.evaluation.report")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        # Everything after `launch` is torchrun's, options included: argparse would claim them.
        args = argparse.Namespace(command="launch", module="diffrelay.runtime.distributed", torchrun=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        # First, before the stage's imports: a worker of `diffrelay launch` must not outlive its agent.
        from diffrelay.runtime import distributed

        distributed.die_with_agent()
        module = importlib.import_module(args.module)
        # fid and fid-ref share a module; each has its own entry point named after the command.
        stage = getattr(module, "main_" + args.command.replace("-", "_"), None) or module.main
        return int(stage(args) or 0)
    except UserError as e:
        print(f"diffrelay: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diffrelay: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `diffrelay` command and `python -m diffrelay`: main(), then a quick exit.

    Python's own shutdown tears down every module object torch loaded, one by one, paid by every job of a run
    and every hand-run command: 0.70 s of CPU and 1.8 s of wall time of a process with a training job's modules
    loaded (benchmarks/bench_internals.py, results/internals.json: median of 7 paired runs on a shared 2-core
    machine at load average 5-10; 0.4-0.7 s of wall time when idle, docs/benchmarks.md#start-up).
    Everything shutdown does that matters runs here first, in its order: non-daemon threads are joined and
    concurrent.futures' pools shut down (threading._shutdown), then the atexit handlers (logging's flush,
    multiprocessing's clean-up of child processes), then the standard streams are flushed. Only the module
    teardown is skipped. threading._shutdown and atexit._run_exitfuncs are private to Python, with no public
    equivalent, and themselves cost nothing measurable (the benchmark's bare_exit); tests/test_internals.py fails,
    naming them, where a Python renames them, and such a Python takes its own shutdown here. An uncaught
    exception still takes Python's normal path (its traceback)."""
    code = main()
    import atexit
    import os
    import threading

    shutdown, exit_functions = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or exit_functions is None:
        sys.exit(code)
    shutdown()
    exit_functions()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
