"""`diffrelay export --lora-format comfyui`: a LoRA run's adapter as one .safetensors file in kohya's key layout,
which ComfyUI's LoRA loader, kohya's sd-scripts and diffusers' own converters (load_lora_weights of a non-diffusers
file) read.

UNets (SD 1.x/2.x, SDXL; kohya sd-scripts' networks/lora.py): "lora_unet_" + the diffusers module's dotted name,
every dot an underscore; <name>.lora_down.weight = peft's lora_A, <name>.lora_up.weight = lora_B and <name>.alpha =
lora_alpha, whose update alpha / rank x up @ down is peft's (lora_alpha / r) x B @ A.

FLUX.1 (sd-scripts' networks/lora_flux.py, whose "lora_unet_" prefix ComfyUI maps onto its diffusion_model. keys):
"lora_unet_" + Black Forest Labs' module names (double_blocks.{i}.img_attn.qkv, single_blocks.{i}.linear1, ...),
where one layer computes what diffusers splits into several: q, k and v of a double block; q, k, v and the MLP's
input of a single block. Such a layer's down is the parts' downs stacked (a part with no adapter: zeros) and its up
is block-diagonal (part j's up in its rows and its own r columns), the layout of sd-scripts' split_qkv files.
Every reader (sd-scripts', ComfyUI's, diffusers') scales a layer by alpha / (rows of down), so alpha here is
lora_alpha x the number of parts (sd-scripts' split_qkv writer keeps the parts' alpha). diffusers' converter
(_convert_kohya_flux_lora_to_diffusers) sees the zero off-diagonal blocks and cuts each part's down and up out again,
the same tensors. It reads only FLUX.1's widths there (3,072 and 12,288 are written into it for single blocks).

Refused in one line: modules outside the double and single blocks (diffusers' converter names them without the
"transformer." prefix its loader keeps, so they would be dropped), SD3's and the other transformers (diffusers has
no reader of kohya's SD3 keys to check a file against; ComfyUI reads SD3's diffusers file, <run>/lora/step_N/, by
its transformer. keys), and every kind but LoRA (kohya's layout has no DoRA magnitude; LoKr/LoHa are peft's files).
"""

import re
from pathlib import Path

from diffrelay import families, io
from diffrelay.errors import UserError

# A family's comfyui layout -> the sd-scripts network module whose keys it writes (the file's ss_network_module).
LAYOUTS = {"kohya": "networks.lora", "kohya-flux": "networks.lora_flux"}
MARK = "diffrelay_export"  # in the file's safetensors metadata: a file this command wrote, which it may replace
PREFIX = "lora_unet_"

# diffusers' FluxTransformer2DModel module inside a block -> (BFL's module, part, parts): BFL's layout of FLUX.1
# (diffusers' single-file converter convert_flux_transformer_checkpoint_to_diffusers, and the kohya converter).
FLUX_DOUBLE = {"attn.to_q": ("img_attn.qkv", 0, 3), "attn.to_k": ("img_attn.qkv", 1, 3),
               "attn.to_v": ("img_attn.qkv", 2, 3), "attn.add_q_proj": ("txt_attn.qkv", 0, 3),
               "attn.add_k_proj": ("txt_attn.qkv", 1, 3), "attn.add_v_proj": ("txt_attn.qkv", 2, 3),
               "attn.to_out.0": ("img_attn.proj", 0, 1), "attn.to_add_out": ("txt_attn.proj", 0, 1),
               "ff.net.0.proj": ("img_mlp.0", 0, 1), "ff.net.2": ("img_mlp.2", 0, 1),
               "ff_context.net.0.proj": ("txt_mlp.0", 0, 1), "ff_context.net.2": ("txt_mlp.2", 0, 1),
               "norm1.linear": ("img_mod.lin", 0, 1), "norm1_context.linear": ("txt_mod.lin", 0, 1)}
FLUX_SINGLE = {"attn.to_q": ("linear1", 0, 4), "attn.to_k": ("linear1", 1, 4), "attn.to_v": ("linear1", 2, 4),
               "proj_mlp": ("linear1", 3, 4), "proj_out": ("linear2", 0, 1), "norm.linear": ("modulation.lin", 0, 1)}
_BLOCK = re.compile(r"(single_transformer_blocks|transformer_blocks)\.(\d+)\.(.+)")


def kohya_keys(layers: dict, alpha: float) -> dict:
    """peft's adapter tensors (get_peft_model_state_dict: <module>.lora_A.weight, <module>.lora_B.weight) of a UNet
    in kohya's layout, with one alpha per module."""
    import torch

    out = {}
    for key, value in layers.items():
        module, _, part = key.rpartition(".lora_")
        name = PREFIX + module.replace(".", "_")
        out[f"{name}.{'lora_down' if part.startswith('A') else 'lora_up'}.weight"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def flux_module(name: str) -> tuple[str, str, int, int]:
    """A diffusers FLUX.1 module's (BFL's module, the diffusers name of its block, part, parts); UserError for a
    module outside the blocks' table."""
    m = _BLOCK.fullmatch(name)
    table = (FLUX_SINGLE if m.group(1).startswith("single") else FLUX_DOUBLE) if m else {}
    if not m or m.group(3) not in table:
        raise UserError(f"--lora-format comfyui: the adapter on {name} has no place in kohya's FLUX.1 layout as "
                        "diffusers reads it back (double_blocks and single_blocks only: "
                        f"{', '.join(sorted(set(FLUX_DOUBLE) | set(FLUX_SINGLE)))}); use <run>/lora/step_N/'s "
                        "diffusers file, or train without it (train.lora.target_modules)")
    bfl, part, parts = table[m.group(3)]
    block = "double_blocks" if m.group(1) == "transformer_blocks" else "single_blocks"
    return f"{block}.{m.group(2)}.{bfl}", f"{m.group(1)}.{m.group(2)}", part, parts


def flux_keys(layers: dict, alpha: float, model) -> dict:
    """peft's adapter tensors of a FluxTransformer2DModel in kohya's FLUX.1 layout (fused layers stacked, see the
    module's docstring); `model` gives a part's width where that part has no adapter."""
    import torch

    fused: dict = {}  # BFL module -> its block's diffusers name, its parts and {part: (lora_A, lora_B)}
    for key in layers:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[:-len(".lora_A.weight")]
        bfl, block, part, parts = flux_module(module)
        fused.setdefault(bfl, {"block": block, "parts": parts, "ab": {}})
        fused[bfl]["ab"][part] = (layers[key], layers[f"{module}.lora_B.weight"])
    out = {}
    for bfl, f in fused.items():
        first = next(iter(f["ab"].values()))[0]
        (rank, width), dtype = first.shape, first.dtype
        table = FLUX_SINGLE if f["block"].startswith("single") else FLUX_DOUBLE
        names = {p: n for n, (b, p, _) in table.items() if b == bfl.split(".", 2)[2]}
        rows = [model.get_submodule(f"{f['block']}.{names[p]}").out_features for p in range(f["parts"])]
        down = torch.zeros(rank * f["parts"], width, dtype=dtype)
        up = torch.zeros(sum(rows), rank * f["parts"], dtype=dtype)
        for p, (a, b) in f["ab"].items():
            down[p * rank:(p + 1) * rank] = a
            up[sum(rows[:p]):sum(rows[:p + 1]), p * rank:(p + 1) * rank] = b
        name = PREFIX + bfl.replace(".", "_")
        out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = down, up
        out[f"{name}.alpha"] = torch.tensor(float(alpha) * f["parts"])
    return out


def owned(path: Path) -> bool:
    """A .safetensors file this command wrote (its metadata says so); nothing else is replaced."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get(MARK) == "comfyui"
    except Exception:  # noqa: BLE001 -- not a safetensors file: not ours
        return False


def check(model_cfg: dict, train_lora: dict | None, out: Path, where: str) -> None:
    """Every refusal before any work, one line each."""
    from diffrelay.pretrained import folder, parts

    if train_lora is None:
        raise UserError(f"{where}: --lora-format comfyui writes a LoRA adapter, and this run trains every weight (no "
                        "train.lora); export the pipeline folder without --lora-format")
    if train_lora.get("kind", "lora") != "lora":
        raise UserError(f"{where}: --lora-format comfyui: kohya's layout holds LoRA's down, up and alpha only; this "
                        f"run's train.lora.kind is {train_lora['kind']} (its files are in <run>/lora/step_N/)")
    pipe = folder.read(model_cfg["pretrained"])
    cls, family = pipe.parts[pipe.net], parts.family(pipe)
    if family.comfyui not in LAYOUTS:
        built = " and ".join(dict.fromkeys(f.comfyui_label for f in families.FAMILIES if f.comfyui in LAYOUTS))
        raise UserError(f"{where}: --lora-format comfyui is built for {built}; a {cls}'s kohya keys are not written "
                        f"(diffusers has no reader of them to check a file against){family.comfyui_hint}")
    if out.suffix != ".safetensors":
        raise UserError(f"{out}: --lora-format comfyui writes one .safetensors file; name --out <name>.safetensors")
    io.check_file_target(out, owned, "a file `diffrelay export --lora-format comfyui` wrote")


def write(net, train_lora: dict, out: Path, record: dict) -> str:
    """Write the adapter of the snapshot's network `net` to `out` (atomic) and read it back; the line that says what
    was written and what was checked (the file read back whole, no other tool's loader run), and for a FLUX.1 of
    other widths than FLUX.1's that diffusers' converter cannot read it."""
    import json

    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load, save

    from diffrelay.pretrained import weights

    model = weights.text_net(net)
    layers = get_peft_model_state_dict(model)
    family = families.of_class(type(model).__name__, dict(model.config))
    layout = family.comfyui if family else None
    if layout not in LAYOUTS:  # check() refused these before any work; a snapshot of another network is named
        raise UserError(f"{out}: --lora-format comfyui: the snapshot's {type(model).__name__} has no kohya layout here")
    flux = layout == "kohya-flux"
    tensors = flux_keys(layers, train_lora["alpha"], model) if flux else kohya_keys(layers, train_lora["alpha"])
    meta = {MARK: "comfyui", "ss_network_module": LAYOUTS[layout],
            "ss_network_dim": str(train_lora["rank"]),
            "ss_network_alpha": str(train_lora["alpha"]), "diffrelay": json.dumps(record, sort_keys=True)}
    io.write_bytes(out, save(tensors, metadata=meta))
    back = load(out.read_bytes())
    if set(back) != set(tensors) or not all(torch.equal(back[k], v) for k, v in tensors.items()):
        raise UserError(f"{out}: read back, the file holds other tensors than were written; check the disk and "
                        "export again")
    n, what = sum(k.endswith(".alpha") for k in tensors), f"{record['weights']} weights of {record['snapshot']}"
    line = (f"diffrelay: wrote {out}: {n} adapted modules ({what}, step {record['step']}) in kohya's keys; checked: "
            "it reads back with the same tensors; ComfyUI's LoRA loader, sd-scripts")
    widths = _flux_widths(model) if flux and any("single_blocks" in k for k in tensors) else FLUX1_WIDTHS
    if widths != FLUX1_WIDTHS:  # diffusers' _convert_kohya_flux_lora_to_diffusers: dims=[3072, 3072, 3072, 12288]
        return (f"{line} read kohya's keys (not run here); diffusers' load_lora_weights cannot read this file: its "
                f"converter cuts a single block's linear1 at FLUX.1's widths {list(FLUX1_WIDTHS)}, and this "
                f"transformer's are {list(widths)} (docs/pretrained.md)")
    return f"{line} and pipe.load_lora_weights({str(out)!r}) read kohya's keys (none of them run here)"


FLUX1_WIDTHS = (3072, 3072, 3072, 12288)  # a single block's q, k, v and MLP input, as diffusers' converter cuts them


def _flux_widths(model) -> tuple:
    block = model.single_transformer_blocks[0]
    return tuple(block.get_submodule(m).out_features for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
