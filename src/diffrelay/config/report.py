"""`diffrelay validate`: check a config, build its network once without training, print both, and the
network's size and cost (parameters, FLOPs of a forward pass) as a YAML comment."""

import contextlib
import json
import os
import sys

import yaml

from diffrelay import config
from diffrelay.config import netcache, preflight
from diffrelay.training import settings
from diffrelay.errors import UserError


def check_network(cfg: config.Config) -> tuple[int, int]:
    """(parameters, classes) of the configured network, built on the meta device and run once on a tiny
    batch; UserError with one line when it cannot be imported, built or run. The Snakefile calls this too."""
    d = cfg.to_dict()
    classes = preflight.num_classes(cfg) if d["model"]["class_conditional"] else 0
    k = netcache.key(cfg, "check", classes)  # a network checked before: its answer, without building it again
    if (hit := netcache.read(cfg, k)) is not None:
        return hit, classes
    from diffrelay.nets import registry

    channels, side = preflight.net_geometry(cfg)
    params = registry.check(d["model"], side, channels, classes, d["train"]["activation_checkpointing"],
                            augment=d["train"]["augment"] > 0, text=text_dims(cfg))
    if d["train"]["lora"] is not None:  # its target modules against the network's, before any work
        from diffrelay import objectives
        from diffrelay.pretrained import lora

        with registry.on_device("meta"):
            net = objectives.build(d["model"], side, classes, channels, text=text_dims(cfg))
        lora.check_targets(net, d["train"]["lora"]["target_modules"])
    netcache.write(cfg, k, params)
    return params, classes


def text_records(cfg: config.Config) -> list | None:
    """The text encoders' records (text/encoders.records: read from their folders' config.json, the weights not
    hashed: only the dims are needed here) of a text run; None without captions. A bad encoder folder is one line."""
    from diffrelay.text import encoders

    d = cfg.to_dict()["data"]
    return encoders.records(d["text_encoders"], hashed=False) if d["captions"] != "none" and d["text_encoders"] \
        else None


def text_dims(cfg: config.Config) -> dict | None:
    """{"states", "length", "pooled"} the network of a text run is built for (the encoders' combined output)."""
    from diffrelay.text import encoders

    records = text_records(cfg)
    return None if records is None else encoders.combined_dims(records)


def text_line(cfg: config.Config) -> str | None:
    """How big the caption cache is and whether it is used (data.text_cache), as a YAML comment; None without text."""
    from diffrelay.data import datasets
    from diffrelay.text import cache

    records = text_records(cfg)
    if records is None:
        return None
    dtype, per = cfg.data.text_dtype, cache.size_bytes(1, records, cfg.data.text_dtype)
    folder = config.run_dir(cfg) / "dataset"
    try:  # the prepared dataset's count of distinct captions, else one per image as an estimate
        count, how = len(datasets.open_prepared(folder).captions.texts), "captions"
    except (UserError, AttributeError):
        count, how = (cfg.data.count if cfg.data.kind == "shapes" else 0), "images, one caption each (estimate)"
    total = f"{count:,} {how}: {per * count / 2**30:.3g} GiB" if count else "times the captions"
    use = ("cached by prepare (data.text_cache: true)" if cfg.data.text_cache
           else "encoded in each training step (data.text_cache: false)")
    return f"# text: {len(records)} encoder(s), {per / 2**20:.3g} MiB a caption in {dtype}, {total}; {use}"


def sample_line(cfg: config.Config) -> str | None:
    """What a text run samples at each checkpoint (and guidance scale), as a YAML comment: a prompt file's images
    replace sample.num_images; held-out captions give one image each, up to it. None without text."""
    s = cfg.sample
    if cfg.data.captions == "none":
        return None
    files = [s.prompts] if isinstance(s.prompts, str) else list(s.prompts or [])
    if files:
        from diffrelay.data import prompts

        parts = []
        for f in files:
            entries = prompts.read(f)
            each = sorted({e.num_images for e in entries})
            per = f"{each[0]} image{'s' * (each[0] > 1)} each" if len(each) == 1 else f"{each[0]}-{each[-1]} images each"
            parts.append(f"{f}: {len(entries)} prompts, {per}, {sum(e.num_images for e in entries)} images")
        return (f"# sample: {'; '.join(parts)} a checkpoint and guidance scale (a prompt's num_images, 1 where the "
                f"file sets none); sample.num_images={s.num_images} applies only without a prompt file")
    return (f"# sample: one image per held-out caption, at most sample.num_images={s.num_images}, a checkpoint and "
            "guidance scale")


def classes_assumed(cfg: config.Config) -> bool:
    """True when preflight.num_classes counted data.path's subfolders: prepare's count may differ (a folder
    without images), so until the dataset is prepared the class count is an assumption."""
    d = cfg.data
    return (cfg.model.class_conditional and d.labels != "none" and d.kind != "shapes"
            and not (config.run_dir(cfg) / "dataset" / "dataset.json").is_file())


def forward_cost(cfg: config.Config, params: int, classes: int) -> str:
    """'<G> GFLOPs per forward (...)' of the run's network as training builds it (objectives.build, on the meta
    device; on the CPU when that fails and the network is small), or 'FLOPs not available: <reason>'."""
    from diffrelay import objectives
    from diffrelay.nets import cost

    channels, side = preflight.net_geometry(cfg)
    model = cfg.to_dict()["model"]
    from diffrelay.nets.registry import CPU_CHECK_MAX_PARAM_PIXELS

    too_big = f"{params / 1e6:.0f} M parameters" if params > cost.CPU_MAX_PARAMS else None
    small = params * side ** 2 <= CPU_CHECK_MAX_PARAM_PIXELS
    # check_network imported a user's module already, outside any device context (nets.registry's note).
    text = text_dims(cfg)
    build = lambda: objectives.build(model, side, classes, channels, text=text)  # noqa: E731
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the YAML; a user's network may print
            flops = cost.measure(build, (1, channels, side, side), classes, cpu=too_big, cpu_first=small,
                                 text=text)["forward"]
    except UserError as e:
        return f"FLOPs not available: {e}"
    # FlopCounterMode counts 2 per multiply-add; DiT's "Gflops" (Table 4) and edm2's count_flops.py count
    # multiply-adds, so both are shown. Elementwise ops are not counted.
    return f"{flops / 1e9:.4g} GFLOPs per forward ({cost.macs(flops) / 1e9:.4g} G multiply-adds, the papers' Gflops)"


def network_line(cfg: config.Config, params: int, classes: int) -> str:
    """The comment line naming the network, its exact parameter count and its forward cost. Parameters as
    DiT's train.py and edm2's count_flops.py count them: every parameter, trainable or not (DiT's frozen
    position table too: nets.registry.num_params); of the network only (EDM's Denoiser adds none)."""
    from diffrelay import nets

    arch, kwargs = nets.arch_kwargs(cfg.to_dict()["model"])
    shown = ", ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in kwargs.items())
    channels, side = preflight.net_geometry(cfg)
    what = f"{classes} classes" + (" assumed (data.path's subfolders; prepare counts them)"
                                   if classes_assumed(cfg) else "")
    return (f"# network: {arch}{f' ({shown})' if shown else ''}, {params:,} parameters ({params / 1e6:.2f} M), "
            f"{forward_cost(cfg, params, classes)} at {side}x{side}x{channels}, {what}")


def bucket_lines(cfg) -> list[str]:
    """data.buckets: each bucket of the folder and its images, and what was merged (each image's header is read,
    as prepare reads it: a minute or two for a million files)."""
    if cfg.data.buckets is None:
        return []
    import numpy as np

    from diffrelay.data import bucketed, datasets

    p = datasets.plan(cfg.data, batch=cfg.train.batch_size)
    counts = np.bincount([b for b in p.bucket_of if b >= 0], minlength=len(p.buckets)).tolist()
    rec = {"settings": p.bucket_settings, "sizes": [list(b) for b in p.buckets], "counts": counts}
    return [f"# buckets: {len(p.buckets)} of {sum(counts)} images (data.buckets; width x height in pixels)",
            *(f"#{line}" for line in bucketed.describe(rec))]


def main(args) -> int:
    cfg = config.load(args.config)
    preflight.check(cfg, ", ".join(args.config))
    try:
        params, classes = check_network(cfg)
    except UserError as e:
        raise UserError(f"{', '.join(map(str, args.config))}: {e}") from e
    print(f"# merged from {', '.join(args.config)} (later files win; schema defaults fill the rest)")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    gpu = getattr(args, "gpu_memory_gib", None)
    # The memory lines compare with this machine's GPUs (footprint.gpu_memory): another machine is another answer.
    here = None if gpu is not None or cfg.run.device == "cpu" else [os.uname().nodename,
                                                                    os.environ.get("CUDA_VISIBLE_DEVICES")]
    k = netcache.key(cfg, "report", [params, classes, gpu, classes_assumed(cfg), here])
    if (hit := netcache.read(cfg, k)) is None:  # the forward's cost and the memory lines: measured once a network
        from diffrelay.config import memory

        hit = [network_line(cfg, params, classes), *memory.lines(cfg, params, classes, text_dims(cfg), gpu)]
        netcache.write(cfg, k, hit)
    net_line, mem_lines, mem_warning = hit
    print(net_line)  # a YAML comment, so stdout stays a valid config
    for line in (text_line(cfg), sample_line(cfg), *bucket_lines(cfg)):
        if line:
            print(line)
    for line in mem_lines:  # `# memory:` lines, and a warning when the GPUs are too small
        print(line)
    if mem_warning:
        print(f"diffrelay: warning: {mem_warning}", file=sys.stderr, flush=True)
    for note in settings.paper_notes(cfg.to_dict()):  # YAML comments, so stdout stays a valid config
        print(f"# note: {note}")
    from diffrelay.evaluation import refsize  # a reference of no more images than features (scores.md says it too)

    from diffrelay.config import inputs  # with data.on_corrupt skip, the images prepare will decode, and those not

    count, skipped = inputs.reference_counter(cfg)
    notes = refsize.config_notes(cfg.to_dict(), count, config.run_dir(cfg) / "dataset")
    for warning in notes + skipped(notes):
        print(f"diffrelay: warning: {warning}", file=sys.stderr, flush=True)
    return 0
