"""`diffrelay export --lora-format comfyui`: a LoRA run's adapter as one .safetensors file in kohya's key layout,
which ComfyUI's LoRA loader, kohya's sd-scripts and diffusers' own converter (load_lora_weights of a non-diffusers
file) read.

Keys (kohya sd-scripts' networks/lora.py: "lora_unet" + the module's dotted name, every dot an underscore): for
each adapted module of the UNet, <name>.lora_down.weight = peft's lora_A, <name>.lora_up.weight = lora_B and
<name>.alpha = lora_alpha, whose update alpha / rank x up @ down is peft's (lora_alpha / r) x B @ A. UNets only
(SD 1.x/2.x, SDXL): kohya's names of FLUX.1's and SD3's transformers are BFL's and Stability's own, with fused
q/k/v projections, not diffusers' modules; those runs keep diffusers' files (<run>/lora/step_N/). LoRA only:
kohya's layout has no DoRA magnitude, and LoKr/LoHa are written as peft saves them.
"""

from pathlib import Path

from diffrelay import io
from diffrelay.errors import UserError

MARK = "diffrelay_export"  # in the file's safetensors metadata: a file this command wrote, which it may replace
PREFIX = "lora_unet_"


def kohya_keys(layers: dict, alpha: float) -> dict:
    """peft's adapter tensors (get_peft_model_state_dict: <module>.lora_A.weight, <module>.lora_B.weight) in kohya's
    layout, with one alpha per module."""
    import torch

    out = {}
    for key, value in layers.items():
        module, _, part = key.rpartition(".lora_")
        name = PREFIX + module.replace(".", "_")
        out[f"{name}.{'lora_down' if part.startswith('A') else 'lora_up'}.weight"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
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
    from diffrelay.pretrained import folder

    if train_lora is None:
        raise UserError(f"{where}: --lora-format comfyui writes a LoRA adapter, and this run trains every weight (no "
                        "train.lora); export the pipeline folder without --lora-format")
    if train_lora.get("kind", "lora") != "lora":
        raise UserError(f"{where}: --lora-format comfyui: kohya's layout holds LoRA's down, up and alpha only; this "
                        f"run's train.lora.kind is {train_lora['kind']} (its files are in <run>/lora/step_N/)")
    pipe = folder.read(model_cfg["pretrained"])
    if pipe.net != "unet":
        raise UserError(f"{where}: --lora-format comfyui is built for UNet pipelines (SD, SDXL); kohya's names of "
                        f"a {pipe.parts[pipe.net]} are its original checkpoint's, with fused q/k/v, not diffusers' "
                        "modules: use <run>/lora/step_N/'s diffusers file")
    if out.suffix != ".safetensors":
        raise UserError(f"{out}: --lora-format comfyui writes one .safetensors file; name --out <name>.safetensors")
    io.check_file_target(out, owned, "a file `diffrelay export --lora-format comfyui` wrote")


def write(net, train_lora: dict, out: Path, record: dict) -> int:
    """Write the adapter of the snapshot's network `net` to `out` (atomic); the number of adapted modules."""
    import json

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save

    from diffrelay.pretrained import weights

    tensors = kohya_keys(get_peft_model_state_dict(weights.text_net(net)), train_lora["alpha"])
    meta = {MARK: "comfyui", "ss_network_module": "networks.lora", "ss_network_dim": str(train_lora["rank"]),
            "ss_network_alpha": str(train_lora["alpha"]), "diffrelay": json.dumps(record, sort_keys=True)}
    io.write_bytes(out, save(tensors, metadata=meta))
    return sum(k.endswith(".alpha") for k in tensors)
