"""What `diffrelay sample` checks and changes of a snapshot's shapes: other sizes (sample.sizes, a prompt entry's
width and height) and the sampler against the snapshot's objective, for a hand run as the config checks them."""

from diffrelay.data import latents as latent_data
from diffrelay.errors import UserError
from diffrelay.sampling.settings import Settings


def sized(meta: dict, size) -> dict:
    """`meta` with the image shapes of `size`, (width, height) in pixels: the network's (C, H / f, W / f), f the
    encoder's factor (1 for pixels), and the decoded images'; `meta` itself for None (the snapshot's own shape)."""
    if size is None:
        return meta
    w, h = size
    c, side = meta["image_shape"][0], meta["image_shape"][1]
    f = latent_data.output_shape(meta)[1] // side
    out = meta | {"image_shape": [c, h // f, w // f]}
    if meta.get("latent") is not None:
        out["latent"] = meta["latent"] | {"image_shape": [3, h, w]}
    return out


def check_size(meta: dict, size, what: str) -> None:
    """A size the network can sample (nets/checks.py, as the config's sample.sizes are checked): one line naming
    `what` (the flag or the prompt file's entry) otherwise."""
    from diffrelay.data.prompts import side_problem
    from diffrelay.nets import checks

    if side_problem(*size):  # the bounds of --size, sample.sizes and prompt files, for a size given any other way
        raise UserError(f"{what}: {side_problem(*size)}")
    side = latent_data.output_shape(meta)[1]
    bad = checks.check_sizes({"arch": "unet", "kwargs": {}} | meta["model"], [size], side // meta["image_shape"][1],
                             side)
    if bad:
        raise UserError(f"{what}: {bad[0][1]}")


def image_shape(meta: dict, items, i: int) -> list:
    """[C, H, W] of image i's PNG: its prompt entry's own size, else the folder's."""
    it = items[i] if items is not None else None
    return latent_data.output_shape(sized(meta, (it.width, it.height)) if it is not None and it.width else meta)


def check_entry_sizes(base: dict, meta: dict, items: list, s: Settings) -> None:
    """The sizes a prompt file gives its entries: ones the network samples (checked against `base`, the snapshot's
    square), and one size in all for samples.npz (the folder's, `meta`'s)."""
    own = {(it.width, it.height): it for it in items if it.width is not None}
    for (w, h), it in own.items():
        check_size(base, (w, h), f"{s.prompts}: prompt {it.prompt_index + 1}: width {w}, height {h}")
    folder = latent_data.output_shape(meta)
    if s.npz and any((h, w) != tuple(folder[1:]) for w, h in own):
        w, h = next(iter(own))
        raise UserError(f"sample.npz: {s.prompts} gives prompts their own size ({w}x{h}) and samples.npz holds images "
                        "of one size; set sample.npz false, or drop the entries' width and height")


def check_ddpm(kind: str, s: Settings, snapshot, shape) -> None:
    """The sampler and its settings against a snapshot's objective (the config's checks, for a hand-run)."""
    ours = s.solver in ("ddpm", "ddim")
    if (kind == "ddpm") != ours and s.scheduler is None:  # a scheduler replaces the solver (schedulers.check)
        fix = "ddpm (or ddim)" if kind == "ddpm" else "heun or euler"
        raise UserError(f"--solver {s.solver}: {snapshot} is a model.objective {kind} network; use {fix}")
    if kind == "ddpm" and s.steps > 1000:
        raise UserError(f"--steps {s.steps}: {snapshot} is a model.objective ddpm network with 1000 timesteps; use "
                        "at most 1000 (DiT samples with 250)")
    wide = {"ddpm": s.ddpm.guided_channels, "flow": s.flow.guided_channels}.get(kind) or 0
    if wide > shape[0]:
        raise UserError(f"sample.{kind}.guided_channels={wide}: {snapshot} has {shape[0]} image "
                        f"channels; use at most {shape[0]} (or null for all)")
    if kind == "ddpm" and (s.edm.changed() or s.flow.changed()):
        raise UserError(f"sample.edm/sample.flow {s.edm.changed() | s.flow.changed()}: {snapshot} is a model.objective "
                        "ddpm network; these are the other objectives' sampler settings; remove them")
    if kind == "ddpm" and s.solver == "ddpm" and s.ddpm.eta and s.scheduler is None:
        raise UserError(f"sample.ddpm.eta={s.ddpm.eta}: eta is DDIM's; use --solver ddim or remove it")
    if kind != "ddpm" and s.ddpm.changed():
        raise UserError(f"sample.ddpm {s.ddpm.changed()}: {snapshot} is a model.objective {kind} network; these "
                        "are the ddpm samplers' settings; remove them")
