"""Step 0's weights of a model.pretrained run: the pipeline's network, read by diffusers' own from_pretrained
(offline, safetensors only, float32), or from_single_file for a single-file checkpoint with its config folder, and
copied into the network diffrelay built from the same config.json. A resume loads its checkpoint over them, as any
run's."""

from pathlib import Path

from diffrelay.errors import UserError


def text_net(net):
    """The diffusers model inside an objective's wrapper (EpsModel, VelocityModel: .net is families.network.TextNet)."""
    inner = getattr(net, "net", net)
    return inner.model


def load_initial(net, spec: dict) -> None:
    """Copy the pipeline's network weights into `net` (an objective's wrapper of a text net), strictly: every
    parameter and buffer of diffusers' state dict, none left over."""
    import torch

    from diffrelay.pretrained import folder

    pipe = folder.read(spec)
    model = text_net(net)
    where = Path(pipe.root) / pipe.net
    try:
        if pipe.single is not None:  # diffusers converts an original layout; the config is the folder's
            where = pipe.single
            source = type(model).from_single_file(str(pipe.single), config=str(pipe.root), subfolder=pipe.net,
                                                  local_files_only=True, torch_dtype=torch.float32)
        else:
            source = type(model).from_pretrained(pipe.root, subfolder=pipe.net, local_files_only=True,
                                                 use_safetensors=True, torch_dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 -- diffusers' loaders raise several kinds (SingleFileComponentError too)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{where}: model.pretrained: diffusers cannot load the {pipe.parts[pipe.net]} "
                        f"({type(e).__name__}: {first}); {folder.FIX}") from e
    try:
        with torch.no_grad():
            model.load_state_dict(source.state_dict(), strict=True)
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{where}: model.pretrained: its weights do not fit the network built from its config.json "
                        f"({first}); {folder.FIX}") from e
