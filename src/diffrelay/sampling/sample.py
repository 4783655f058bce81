"""`diffrelay sample`: PNGs from a snapshot, one seed per image, shared out over processes without communication.

  diffrelay sample --snapshot results/demo/snapshots/step_0000400.safetensors --out results/demo/samples/step_0000400
  torchrun --standalone --nproc-per-node 2 -m diffrelay sample --config config/config.yaml \\
      --snapshot results/demo/snapshots/step_0000400.safetensors --out results/demo/samples/step_0000400

Image i uses seed first_seed + i, and process r of W makes images r, r + W, r + 2W, ... (round robin), so the
files do not depend on the process count. --size WxH (sample.sizes) samples another size than the snapshot's
square: the noise is (C, H / f, W / f), f the encoder's factor (1 for pixels); a prompt file's entry may give its
own size. Work happens in `<parent>/.<out>.partial/`; images already there are kept, so a killed job continues. The process that finishes last (it sees every rank's done marker) writes
grid.png and manifest.json and renames the folder to `out`.
"""

import collections
import dataclasses
import io as bytes_io
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from diffrelay import config, families, io, logs, objectives, pretrained
from diffrelay.data import latents as latent_data
from diffrelay.sampling.settings import PIXEL_KEYS, Settings
from diffrelay.runtime import distributed, speed
from diffrelay.sampling import export, guidance, pipeline, prompted, schedulers, settings, shapes
from diffrelay.sampling.progress import Progress
from diffrelay.text import source as text_source
from diffrelay.training import checkpoint
from diffrelay.errors import UserError
from diffrelay.sampling.folder import (MANIFEST_FORMAT, check_out, file_record, image_files, is_sample_folder, lock,
                                       marker, open_work, png_name, read_json_or_none, reuse_intact, up_to_date,
                                       work_dir)
from diffrelay.sampling.images import (GRID_TILE_PX, encode_png, grid_picks, grid_title, is_valid_png, make_grid,
                                       read_png)

# CPU conv/linear kernels give bitwise-identical per-row results only for forward batches of at least 16 rows
# (measured: 16/32/64 rows agree exactly; 1-12 rows differ in the last bits, which can flip a pixel after
# rounding). So every forward batch has forward_rows(settings) rows, a multiple of this, padded where short:
# the PNGs then do not depend on the batch size or the process count. On GPUs cuDNN may pick different kernels
# for different batch sizes, so there only the process count and resuming are sure not to matter (the shape
# of every forward batch depends on the settings alone).
PAD_ROWS = 16


# ---------------------------------------------------------------------------------------------
# Pure helpers: which images, which seeds, which classes


def rank_share(num_images: int, rank: int, world: int) -> range:
    """Indices made by process `rank` of `world`: round robin, so each process gets about the same work."""
    return range(rank, num_images, world)


def latents(seeds, shape) -> torch.Tensor:
    """(len(seeds), C, H, W) float32 noise on the CPU; row k depends only on seeds[k], whatever the device."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


def forward_rows(s: "Settings") -> int:
    """Rows of every forward batch: batch_size (or num_images, if fewer) rounded up to a multiple of PAD_ROWS."""
    return math.ceil(min(s.batch_size, s.num_images) / PAD_ROWS) * PAD_ROWS


def is_conditional(meta: dict) -> bool:
    return bool(meta["model"].get("class_conditional")) and meta.get("num_classes", 0) > 0


def class_labels(indices, meta: dict, spec) -> list[int] | None:
    """Class of each image (None for an unconditional model): balanced = i mod classes, or one fixed index."""
    n = meta.get("num_classes", 0)
    if not is_conditional(meta):
        if spec != "balanced":
            raise UserError(f"sample.class_labels={spec} (--class-labels): the model is unconditional; use balanced")
        return None
    if spec == "balanced":
        return [i % n for i in indices]
    if not 0 <= spec < n:
        raise UserError(f"sample.class_labels={spec} (--class-labels): no such class; "
                        f"the model has {n} classes, use 0..{n - 1} or balanced")
    return [spec for _ in indices]


# ---------------------------------------------------------------------------------------------
# Generation


class NonFiniteSamples(UserError):
    """A batch came out with NaN or inf values (run() names the snapshot)."""


def generate(net, meta: dict, indices, s: Settings, device=None, guide=None, decoder=None, text=None, items=None,
             rules=None):
    """Yield (index, uint8 array H x W x C) for each index, in order. No files; the caller decides what to keep.
    text, items: a text run's TextSource and prompt items (sampling/prompted.py): image i is items[i]; rules:
    prompted.condition's (a pipeline's own treatment of prompts, pretrained.PromptRules)."""
    device = torch.device(device or next(net.parameters()).device)
    shape = tuple(meta["image_shape"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=s.precision == "bf16")

    def plain(x, sigma, labels):
        with autocast:
            return net(x, sigma, labels)

    scale, flux, family = *guidance.classifier_free(meta["model"], s.guidance), families.of_config(meta["model"])
    true_cfg = guidance.true_cfg_scale(meta["model"], s.true_cfg_scale) > 1  # FLUX.1's, with negative prompts
    # ddpm's networks may also output the variance: guidance extrapolates the noise only (sample.ddpm).
    kind = objectives.objective(meta["model"])
    channels = (s.ddpm.guided_channels or shape[0]) if kind == "ddpm" else s.flow.guided_channels if kind == "flow" \
        else None
    # A diffusers scheduler gets the pipelines' row order (unconditional first); the samplers keep today's call.
    order = {"uncond_first": True} if s.scheduler is not None else {}
    denoise = guidance.guided(plain, scale, meta.get("num_classes", 0), channels, **order)  # the null class
    if guide is not None and scale != 1:

        def reference(x, sigma, labels):
            with autocast:
                return guide(x, sigma, labels)

        denoise = guidance.autoguided(plain, reference, scale, channels)
    interval = s.guidance_interval if scale != 1 else None
    scheduler = None if s.scheduler is None else schedulers.build(s, meta["model"], "sample.scheduler")

    indices, rows = list(indices), forward_rows(s)
    for start in range(0, len(indices), s.batch_size):
        batch = indices[start:start + s.batch_size]
        padded = batch + [batch[0]] * (rows - len(batch))  # padding rows repeat the first and are discarded
        # One generator per image, seeded by its seed: its latent first, then EDM's churn noise, as EDM's
        # StackedRandomGenerator does, so an image is the same in any batch and on any process count.
        gens = [torch.Generator().manual_seed(s.first_seed + i if items is None else items[i].seed) for i in padded]
        x = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device)

        def noise(size, gens=gens):  # page-locked on CUDA: the copy is queued, not waited for (the sampler asks ahead)
            host = torch.empty(size, dtype=torch.float64, pin_memory=device.type == "cuda")
            return torch.stack([torch.randn(size[1:], generator=g, dtype=torch.float64) for g in gens],
                               out=host).to(device, non_blocking=True)

        labels = class_labels(padded, meta, s.class_labels)
        labels = None if labels is None else torch.tensor(labels, device=device)
        if text is not None:
            labels = prompted.condition(text, [items[i] for i in padded], device, labels, scale != 1 or true_cfg,
                                        meta.get("num_classes", 0), rules, s.guidance if flux else None)
        step = guidance.true_cfg(denoise, s.true_cfg_scale, [items[i] for i in padded]) if true_cfg else denoise
        with torch.inference_mode():
            if scheduler is not None:  # a diffusers scheduler's steps, its noise from the same generators
                images = schedulers.sample(step, x, labels, s.steps, scheduler, gens, s.ddpm.eta, family)
            else:
                images = objectives.sample(meta["model"], step, x, labels, s.steps, s.solver, s.edm, s.flow,
                                           noise, unguided=plain, interval=interval, ddpm_settings=s.ddpm)
            # NaN would become black pixels (the uint8 cast maps it to 0) and be scored as an image; the flag
            # travels to the host with the pixels, so the check costs no extra synchronisation.
            finite = torch.isfinite(images).flatten(1).all(1)[:len(batch)]
            if decoder is None:
                pixels = (images[:len(batch)] * 127.5 + 128).clamp(0, 255).to(torch.uint8)
            else:  # the whole padded batch: its fixed shape keeps each image's bytes independent of the batch
                pixels = latent_data.decode(decoder, images, meta["latent"])[:len(batch)]
        finite, pixels = finite.cpu().numpy(), pixels.permute(0, 2, 3, 1).cpu().numpy()
        if not finite.all():
            bad = [s.first_seed + i if items is None else items[i].seed for i, ok in zip(batch, finite) if not ok]
            raise NonFiniteSamples(
                f"sampling gave NaN or inf for seed(s) {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''} "
                f"(guidance {s.guidance:g}, precision {s.precision}, {s.steps} {s.scheduler or s.solver} steps); likely a guidance "
                "scale too large, a bf16 overflow, or a network that returns NaN in eval mode; nothing was written "
                "for these images")
        yield from zip(batch, pixels)


def finalize(work: Path, out: Path, meta: dict, s: Settings, manifest: dict, world: int) -> dict | None:
    """Write grid.png and manifest.json and rename the folder to `out`; None if another process does it."""
    fd = lock(work)
    if fd is None:
        return None
    try:
        missing = [i for i in range(s.num_images) if not (work / png_name(i)).is_file()]
        if missing:
            raise RuntimeError(f"{work}: all done markers present but image {missing[0]} is missing")
        every = range(s.num_images)  # the grid shows every prompt (or class) once where its cells allow
        labels, known = class_labels(every, meta, s.class_labels), meta.get("class_names") or []
        names = None if labels is None else [str(known[c]) if c < len(known) else str(c) for c in labels]
        prompts = [prompted.sidecar(work / png_name(i)) for i in every]
        text = meta.get("text") is not None and all(p.is_file() for p in prompts)
        if text:  # a text run's grid is labelled with each image's prompt, on wider tiles
            names = [p.read_text(encoding="utf-8") for p in prompts]
        first, what = grid_picks(names or [None] * s.num_images)
        tiles = [pixels.reshape(pixels.shape[0], pixels.shape[1], -1)  # H x W x C: an entry may have its own size
                 for pixels in (read_png(work / png_name(i)) for i in first)]
        title = grid_title(meta, s) + (f" | {what} {'prompts' if text else 'classes'}" if what else "")
        buf = bytes_io.BytesIO()
        make_grid(tiles, names and [names[i] for i in first], title,
                  tile_px=2 * GRID_TILE_PX if text else GRID_TILE_PX).save(buf, format="PNG")
        io.write_bytes(work / "grid.png", buf.getvalue())
        # sample.npz: samples.npz from the PNG files as written, with the labels generate() gave each image.
        exported = export.finish(work, s.npz, s.num_images, class_labels(range(s.num_images), meta, s.class_labels))
        # Rate of this launch: images made (not skipped) by all ranks over this process's wall time.
        generated = sum((read_json_or_none(marker(work, r, world)) or {}).get("generated", 0) for r in range(world))
        finished = time.time()
        seconds = finished - manifest["started"]
        manifest |= {"finished": finished, "seconds": round(seconds, 3), "generated": generated,
                     "images_per_s": round(generated / max(seconds, 1e-9), 3),
                     "files": {p.name: file_record(p) for p in [*image_files(work), *sorted(work.glob("[0-9]*.txt")),
                                                                work / "grid.png", *exported]}}
        io.write_json(work / "manifest.json", manifest)
        # Bookkeeping and temp files of writes a kill interrupted do not belong in the result.
        for p in [work / "settings.json", *work.glob("done-*.json"), *work.glob(".*.tmp")]:
            p.unlink(missing_ok=True)
        io.replace_dir(work, out, owned=is_sample_folder)
        return manifest
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Entry points


def _generate(model, meta, todo, s, device, guide, decoder, text, items, rules=None):
    """generate(), in one call per (guidance, steps, size) of a text run's items (a prompt entry may set its own)."""
    if items is None:
        yield from generate(model, meta, todo, s, device, guide, decoder)
        return
    for g, steps, size, part in prompted.groups(items, todo, s.guidance, s.steps):
        yield from generate(model, shapes.sized(meta, size), part, dataclasses.replace(s, guidance=g, steps=steps), device,
                            guide, decoder, text, items, rules)


def _write_image(path: Path, pixels, prompt: str | None) -> None:
    """The PNG, after its prompt's sidecar (a text run): a PNG on disk always has its prompt beside it."""
    if prompt is not None:  # UTF-8 whatever the locale: finalize and CLIP score read it so
        io.write_bytes(prompted.sidecar(path), prompt.encode("utf-8"), parents=False)
    io.write_bytes(path, encode_png(pixels), parents=False)


def run(snapshot, out, s: Settings, device="cpu", rank: int = 0, world: int = 1, model_cfg=None,
        resources="resources", data_cfg=None, dataset=None) -> dict | None:
    """Make this process's share of the images in `out`'s work folder, and finalize if it finishes last.

    Returns the manifest when `out` is complete (this process finalized it, or it was up to date), else None.
    model_cfg: the run config's `model` section, which names the network (see checkpoint.load_snapshot).
    `resources` holds the compile cache (sample.compile).
    """
    started = time.time()
    snapshot, out, device = Path(snapshot), Path(out), torch.device(device)
    log = logs.get()
    check_out(out)
    torch.set_num_threads(s.threads)
    speed.set_backends(device, s.tf32, "sample.tf32")  # strict fp32 unless sample.tf32, as training's train.tf32

    # Snapshot (verified by its own sha256) or a pipeline folder, and the cheap checks that need its metadata.
    net, meta, identity, s = pipeline.open_any(snapshot, s, device, model_cfg, data_cfg, resources)
    side = latent_data.output_shape(meta)[1]  # the snapshot's square, in pixels
    if s.size is not None and tuple(s.size) == (side, side):
        s = dataclasses.replace(s, size=None)  # the square: the folder it always was
    base = meta  # the square's shapes, which the sizes are checked against
    if s.size is not None:  # sample.sizes: the network's shapes of this size (its folder's key has them)
        shapes.check_size(base, tuple(s.size), f"--size {s.size[0]}x{s.size[1]} (sample.sizes) for {snapshot}")
        meta = shapes.sized(meta, tuple(s.size))
    shape = tuple(meta["image_shape"])
    decoder = latent_data.load_decoder(meta, snapshot, data_cfg, resources, device)  # latent snapshots
    class_labels([0], meta, s.class_labels)
    text = text_source.for_sampling(meta, data_cfg, snapshot)  # None: not a text run
    items = None if text is None else (prompted.items(s.prompts, s.first_seed) if s.prompts else
                                       prompted.held_out(dataset, s.first_seed, s.num_images))
    prompted.refuse_mismatch(meta, items is not None or s.prompts is not None, snapshot)
    rules = pretrained.prompt_rules(model_cfg or meta["model"]) if text is not None else None
    if items is not None:
        s = dataclasses.replace(s, num_images=len(items))
        prompted.check(meta, items, s.guidance if guidance.distilled(meta["model"]) is None else
                       guidance.true_cfg_scale(meta["model"], s.true_cfg_scale), snapshot)
        shapes.check_entry_sizes(base, meta, items, s)
    guide = None
    if s.guide is not None and s.guidance != 1:  # autoguidance: checked against the sampled network's record
        guide = guidance.load_guide(s.guide, base, s.weights, device)  # the square's record against the guide's
    elif text is None:
        guidance.check(s.guidance, meta, snapshot)
    s = dataclasses.replace(s, weights=checkpoint.weights_of(meta, s.weights))  # raw where the run kept no EMA
    kind = objectives.objective(meta["model"])
    if kind == "edm" and s.solver == "sde":
        raise UserError(f"--solver sde: {snapshot} is a model.objective edm network and sde is flow's sampler; use "
                        "heun or euler (EDM's stochastic sampler is heun with --s-churn above 0)")
    if kind == "flow" and s.edm.changed():
        raise UserError(f"sample.edm {s.edm.changed()}: {snapshot} is a model.objective flow network and these are "
                        "EDM's sampler settings; use sample.flow (--flow-shift, --flow-last-step)")
    shapes.check_ddpm(kind, s, snapshot, shape)
    # sample.scheduler: pipeline reads the folder the config names (it may have moved), else the recorded one;
    # the sampler (generate) builds its scheduler from meta["model"] too.
    if (model_cfg or {}).get("pretrained") is not None:
        meta = meta | {"model": meta["model"] | {"pretrained": model_cfg["pretrained"]}}
    scheduler = None if s.scheduler is None else schedulers.build(s, meta["model"], snapshot)
    key = {k: getattr(s, k) for k in PIXEL_KEYS} | {"snapshot_sha256": identity,
                                                     "image_shape": list(latent_data.output_shape(meta))}
    if s.edm.changed():  # only then: folders made with the defaults (and before sample.edm existed) stay valid
        key["edm"] = s.edm.changed()
    if s.flow.changed():
        key["flow"] = s.flow.changed()
    if s.ddpm.changed():
        key["ddpm"] = s.ddpm.changed()
    if rules is not None:  # SDXL's zeros, PixArt's lower-casing: other pixels than before they were
        key |= rules.key()
    if s.guidance_interval is not None and s.guidance != 1:
        key["guidance_interval"] = list(s.guidance_interval)
    if s.weights == "ema" and checkpoint.ema_index(snapshot, meta, s.ema_decay):  # only then: folders of the
        key["ema_decay"] = s.ema_decay  # first EMA keep the key they had
    if guide is not None:  # only then: CFG folders keep the key they had
        key["guide_sha256"] = io.sha256_file(s.guide)
    if s.tf32 and device.type == "cuda":  # only then: it changes no pixel elsewhere, and older folders stay valid
        key["tf32"] = True
    for name, off in (("quantize_base", None), ("true_cfg_scale", 1)):  # only when set: other folders keep their key
        if getattr(s, name) != off:
            key[name] = getattr(s, name)
    if items is not None:  # prompts, not classes: no class_labels (folders written with it still match)
        key["prompts"] = prompted.fingerprint(items)
        del key["class_labels"]
    if scheduler is not None:  # only then: folders of the objectives' samplers keep the key they had
        key["scheduler"] = schedulers.record(scheduler)
    done = up_to_date(out, key)
    damaged, changed = export.check(out, done, s.npz) if done else ([], [])  # changed: samples.npz to add/remove
    if done and not damaged and not changed:
        log.info("%s: up to date (%d images from step %s)", out, done["num_images"], done["step"])
        return done
    if damaged:
        log.warning("%s: %d file(s) differ from manifest.json (e.g. %s); making them again", out, len(damaged),
                    damaged[0])
    if changed:
        log.info("%s: sample.npz %s: %s %s; the images are kept", out, str(s.npz).lower(),
                 "adding" if s.npz else "removing", changed[0])

    # This process's share, minus images a killed run already wrote.
    work = work_dir(out)
    if not open_work(work, out, key, rank, done):
        return up_to_date(out, key)
    mine = rank_share(s.num_images, rank, world)
    if damaged or changed:
        reuse_intact(out, work, mine, set(damaged))
    todo = [i for i in mine if not is_valid_png(work / png_name(i), shapes.image_shape(meta, items, i))
            or (items is not None and not prompted.sidecar(work / png_name(i)).is_file())]
    if not work.is_dir():  # finalized and renamed by another process since open_work
        return up_to_date(out, key)
    if len(todo) < len(mine):
        log.info("resuming: %d of %d images of this process already in %s; skipping them",
                 len(mine) - len(todo), len(mine), work)
    log.info("sampling %d images (%d here) from %s, step %s, %s weights, %d %s steps, %d process(es), device %s",
             s.num_images, len(todo), snapshot, meta["step"], s.weights, s.steps, s.scheduler or s.solver, world,
             device)

    if text is not None and todo:  # before any image: prompts the encoders cut, said once
        prompted.say_cut(text, items, device, rules)
    try:
        progress = Progress(len(todo), s.batch_size)
        # One writer thread: the fsyncs of each atomic write (about 8% of the time on a local disk) then overlap
        # the next batch's compute. Errors surface at the next image and at the end.
        with ThreadPoolExecutor(max_workers=1) as writer:
            pending = collections.deque()
            model = speed.compile_model(net, s.compile, resources, s.threads)
            try:
                images = _generate(model, meta, todo, s, device, guide, decoder, text, items, rules)
                for n, (i, pixels) in enumerate(images, start=1):
                    pending.append(writer.submit(_write_image, work / png_name(i), pixels, items and items[i].prompt))
                    while pending and pending[0].done():
                        pending.popleft().result()
                    line = progress.update(n)
                    if line:
                        log.info("%s", line)
            except NonFiniteSamples as e:
                raise UserError(f"{snapshot}: {e}") from e
            for f in pending:
                f.result()

        # Done marker, then the last process to finish writes grid and manifest and renames the folder.
        record = {"rank": rank, "world": world, "generated": len(todo), "started": started, "finished": time.time()}
        io.write_json(marker(work, rank, world), record, parents=False)
        if not all(marker(work, r, world).exists() for r in range(world)):
            return None
        manifest = {"format": MANIFEST_FORMAT, "snapshot": str(snapshot), "step": meta["step"], **key,
                    "batch_size": s.batch_size, "threads": s.threads, "nproc": world, "device": str(device),
                    "tf32": s.tf32,
                    "num_classes": meta.get("num_classes", 0) if is_conditional(meta) else 0, "started": started,
                    "class_names": list(meta.get("class_names") or []) if is_conditional(meta) else [],  # class_accuracy
                    "phema": meta.get("phema")}  # a post-hoc EMA reconstruction's width and error (training/phema.py)
        result = finalize(work, out, meta, s, manifest, world)
        if result:
            log.info("%s: %d images, grid.png, manifest.json (%.1f img/s)", out, s.num_images, result["images_per_s"])
        return result
    except UserError:
        # Another run into the same --out may have finished first and published the shared work folder; this
        # run's next write then fails (parents=False: it never makes the folder anew). That result is ours too.
        done = None if work.is_dir() else up_to_date(out, key)
        if done is None:
            raise
        log.info("%s: finished by another process meanwhile (%d images)", out, done["num_images"])
        return done


def default_settings(**overrides) -> "Settings":
    """Schema defaults with some keys replaced, e.g. default_settings(num_images=64, steps=8)."""
    return dataclasses.replace(Settings.from_section(config.validate({})["sample"]), **overrides)


def configured(args) -> tuple[dict, bool, Settings, dict]:
    """(config, whether it names the network, settings, run section): the flags over the files' keys first."""
    files = (config.merged(args.config).get("sample") or {}) if args.config else None
    cfg, given = config.sample_config(args.snapshot, args.config, getattr(args, "resolution", None), args.prompts,
                                      settings.layered(args, files))  # --guidance 3 over a file's 1, --weights, ...
    return (cfg, given, *settings.from_args(args, cfg, config.validate))


def main(args) -> int:
    rank, world = distributed.env_rank(), distributed.env_world()
    logs.setup(main=rank == 0)
    cfg, given, s, run_cfg = configured(args)
    want = getattr(args, "prompts_sha256", None)
    if want and s.prompts and io.sha256_file(s.prompts) != want:  # edited after the workflow planned this job
        raise UserError(f"{s.prompts}: changed since the workflow planned this job (sha256 {want[:12]}); run "
                        "snakemake again, which samples the file as it is now")
    run(args.snapshot, args.out, s, distributed.pick_device(run_cfg["device"]), rank, world, cfg["model"] if given else None,
        run_cfg["resources"], cfg["data"] if given else None,
        config.run_dir(config.Config(cfg)) / "dataset" if args.config else None)
    return 0
