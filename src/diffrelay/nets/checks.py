"""What can be checked about a `model` section without torch and without building the network (config
validation runs it at Snakefile parse time; nets.registry.check builds and runs the network). Each problem is
a (key, message) pair; config.validate reports the first.

Imports the base modules, nets and families only.
"""

import json

from diffrelay import families, nets


def check_model(m: dict, res: int) -> list[tuple[str, str]]:
    """What can be checked about the network without building it (nets.registry.check builds it)."""
    bad, arch = [], m["arch"]
    if not nets.is_builtin(arch) and (arch.count(":") != 1 or not all(arch.split(":"))):
        return [(f"model.arch={json.dumps(arch)}", f"use one of {', '.join(nets.BUILTIN)} or 'package.module:callable'")]
    bad = nets.check_kwargs(m)
    if bad:
        return bad
    if arch in ("dit", *nets.TEXT_ARCHS) and m["objective"] == "ddpm" and m["kwargs"].get("time_scale", 1000) != 1:
        who = "DiT" if arch == "dit" else "diffusers"
        bad.append(("model.kwargs.time_scale", f"model.objective ddpm gives {arch} its integer timesteps 0..999, "
                    f"which {who} embeds as they are; set model.kwargs.time_scale: 1"))
    bad += _text_geometry(m, res)
    if arch == "sit" and m["objective"] != "flow":
        bad.append(("model.arch=sit", "SiT's network predicts SiT's velocity; set model.objective: flow (or use dit)"))
    if arch == "edm2":
        if m["objective"] != "edm":
            bad.append(("model.arch=edm2", "edm2's network is trained with EDM's objective and its learned uncertainty; "
                        "set model.objective: edm"))
        preset = m["kwargs"].get("preset")
        if preset is not None and preset not in nets.EDM2_SIZES:
            bad.append((f"model.kwargs.preset={json.dumps(preset)}", f"choose one of {', '.join(nets.EDM2_SIZES)}"))
    if arch in nets.DEFAULT_LEVELS:
        mult = m["kwargs"].get("channel_mult")
        levels = len(mult) if isinstance(mult, list) and mult else nets.DEFAULT_LEVELS[arch]
        if res % 2 ** (levels - 1):
            bad.append((f"data.resolution={res}", f"{arch}'s UNet with {levels} levels halves it {levels - 1} times; "
                        f"use a multiple of {2 ** (levels - 1)} or change model.kwargs.channel_mult"))
    if arch in ("dit", "sit"):
        patch = m["kwargs"].get("patch", 2)
        if not isinstance(patch, int) or patch < 1 or res % patch:
            bad.append((f"model.kwargs.patch={patch}", f"does not divide data.resolution={res}; use 2, 4 or 8 "
                        "(a divisor of the resolution)"))
        size = m["kwargs"].get("size")
        if size is not None and size not in ("S", "B", "L", "XL"):
            bad.append((f"model.kwargs.size={json.dumps(size)}", "choose one of S, B, L, XL"))
    if arch != "unet":
        return bad
    preset = m["kwargs"].get("preset")
    if preset is not None and preset not in nets.UNET_PRESETS:
        return [(f"model.kwargs.preset={json.dumps(preset)}", f"choose one of {', '.join(nets.UNET_PRESETS)}")]
    u = nets.unet_settings(m)
    levels = len(u["channel_mult"])
    factor = 2 ** (levels - 1)
    if res % factor or res // factor < 4:
        bad.append((f"data.resolution={res}",
                    f"not supported by a UNet with {levels} levels (needs a multiple of {factor} "
                    f"and at least {4 * factor}); change data.resolution or model.channel_mult"))
    level_res = [res // 2**i for i in range(levels)]
    for r in u["attn_resolutions"]:
        if r not in level_res:
            bad.append((f"model.attn_resolutions={r}",
                        f"no UNet level has that resolution; choose from {level_res}"))
    return bad


def _text_geometry(m: dict, res: int) -> list[tuple[str, str]]:
    """The side a pipeline family's network can take (its family's geometry: the UNet's halvings, a transformer's
    patches, FLUX.1's 2 x 2 tokens)."""
    family = families.of_config(m)
    return family.geometry(m["kwargs"], res) if family else []


def downsampling(m: dict) -> int | None:
    """How much the network shrinks its input's sides (each side must be a multiple); None for a network with
    position tables of one size (DiT, SiT), which takes no other; 1 for your own network (its own check decides)."""
    arch, kw = m["arch"], m["kwargs"]
    if arch in ("dit", "sit"):
        return None
    family = families.of_config(m)
    if family:
        return family.downsampling(kw)
    if arch == "unet":
        return 2 ** (len(nets.unet_settings(m)["channel_mult"]) - 1)
    if arch in nets.DEFAULT_LEVELS:
        mult = kw.get("channel_mult")
        return 2 ** ((len(mult) if isinstance(mult, list) and mult else nets.DEFAULT_LEVELS[arch]) - 1)
    return 1


def check_sizes(m: dict, sizes, vae: int, res: int) -> list[tuple[str, str]]:
    """(key, message) for sample.sizes ([width, height] in pixels) that the network cannot sample: a size other than
    the data.resolution square for a network with position tables of one size (downsampling None: DiT's, SiT's;
    the diffusers transformers make theirs for any grid: PixArt's and HunyuanDiT's anew, SD3's cropped from its
    pos_embed_max_size table, FLUX's rotary ids from the grid), a side that the encoder's factor `vae` (1 for
    pixels) times the network's down-sampling does not divide, SD3's table too small, a UNet's deepest level under
    4 pixels."""
    arch, down = m["arch"], downsampling(m)
    for w, h in sizes or []:
        key = f"sample.sizes=[{w}, {h}]"
        if (w, h) == (res, res):
            continue
        if down is None:
            return [(key, f"model.arch={arch} has position tables for data.resolution={res}, so it samples "
                     f"{res}x{res} images only; drop the size, or use a network without them (a UNet, or a "
                     "pipeline's transformer)")]
        whole = vae * down
        if w % whole or h % whole:
            near = [-(-x // whole) * whole for x in (w, h)]
            why = f"the encoder's factor {vae} x the network's down-sampling {down}" if vae > 1 else \
                "the network's down-sampling"
            return [(key, f"each side must be a multiple of {whole} ({why}); use e.g. {near}")]
        if arch == "unet" and min(w, h) // whole < 4:
            return [(key, f"the UNet's deepest level needs 4 pixels a side, so each side must be at least "
                     f"{4 * whole}")]
        family = families.of_config(m)
        table = family.position_table(m["kwargs"]) if family else None
        if table and max(w, h) // whole > table:
            return [(key, f"{family.short}'s position table covers pos_embed_max_size={table} patches a side "
                     f"({table * whole} pixels); use sides of at most {table * whole}")]
    return []
