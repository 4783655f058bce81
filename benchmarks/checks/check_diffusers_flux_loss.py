"""Our flow-matching loss for FLUX.1 (diffrelay.objectives.flow, train.flow uniform with the FLUX network of
families/flux.py) against the loss lines of diffusers' train_dreambooth_lora_flux.py, on the same latents, noise,
times and transformer weights.

  python benchmarks/checks/check_diffusers_flux_loss.py --diffusers-src /path/to/diffusers/src

--diffusers-src is the `src` folder of a diffusers checkout; diffusers is imported from there. The script is read
from <src>/../examples/dreambooth/train_dreambooth_lora_flux.py (or --script). Nothing of diffusers enters the
package.

The script's lines are taken with `ast`: its nested get_sigmas, and the statements of the `accelerator.accumulate`
block from `noise = torch.randn_like(model_input)` to the first `loss = loss.mean()`, preceded by the block's
earlier statements that assign what those lines read and the namespace cannot hold as given (vae_scale_factor,
from vae_config_block_out_channels, and latent_image_ids, from FluxPipeline._prepare_latent_image_ids). They run in
a namespace holding args (weighting_scheme "none", guidance_scale 3.5, with_prior_preservation False), a
FlowMatchEulerDiscreteScheduler (noise_scheduler_copy) with the case's config, diffusers' FluxPipeline (its
_pack_latents, _unpack_latents, _prepare_latent_image_ids) and compute_loss_weighting_for_sd3, a VAE config of
scale factor 2, the latents, the text tensors (text_ids zeros, as the script's encode_prompt makes them),
unwrap_model the identity, and a real tiny FluxTransformer2DModel. Its time draw
(compute_density_for_timestep_sampling) returns the case's u, and torch.randn_like the case's noise.

Ours is diffrelay.families.flux.FAMILY.build (the same transformer, loaded with the script side's state dict: it
packs 2 x 2 latent pixels into a token, makes img_ids, feeds model.kwargs.guidance) called through
flow.VelocityModel with a text.condition.Text, and flow.loss with TrainSettings("uniform", shift 1): t = Phi(n),
the velocity loss. The script rounds u to one of the scheduler's 1000 sigmas (indices = (u * 1000).long(); with
FLUX.1-dev's dynamic shifting, and with schnell's shift 1, the training table is unshifted, sigma = (1000 - i) /
1000); ours is handed the normal draw n = Phi^-1(sigma) (torch.special.ndtri, float64), so both see the same x_t
and time.

Cases: dev (scheduler shift 3, use_dynamic_shifting, base_shift 0.5, max_shift 1.15, base_image_seq_len 256,
max_image_seq_len 4096; guidance_embeds, the guidance input 3.5), schnell (shift 1, no dynamic shifting; no
guidance input) and dev-prior (dev with --with_prior_preservation and --prior_loss_weight 0.7: the batch's last
three rows are the class images, the script's lines run on to its `loss + args.prior_loss_weight * prior_loss`;
ours weighs the rows as diffrelay's loader does under data.subsets' is_reg, data.subsets.prior_weights). Compared: the packed x_t each transformer saw (max abs), its time input (ours t against the
script's timesteps / 1000, max abs), its guidance input (equal: None for schnell), its img_ids and txt_ids (max
abs), the loss (relative); rounding/*: |sigma - (1 - u)|, the distance of the script's time from the continuous
time diffrelay draws, at most one table step; table/*: the sigma table the script's lines index
(noise_scheduler_copy.sigmas) against the unshifted grid (1000 - i) / 1000 in float64 (max abs): the time
diffrelay trains FLUX with is unshifted, and a shifted training table moves both sides' x_t and time alike (ours is
handed the script's sigma), so it would show only there and in rounding/*. Bounds: BOUNDS; exit status 1 with one
FAIL line per figure outside its bound. Writes benchmarks/results/diffusers_flux_loss.json.
tests/test_flow_flux_loss.py runs it against the installed diffusers and a stand-in script.
"""

import ast
import inspect
import time
import types
from pathlib import Path

import torch
from official import Gate, script_command, write_results

from check_diffusers_objective import import_diffusers
from check_diffusers_sd3_loss import accumulate_block
from diffrelay.data import subsets
from diffrelay.families import flux as flux_family
from diffrelay.objectives import flow
from diffrelay.text.condition import Text

B, C, H, W = 6, 4, 4, 6  # a non-square latent: packing and img_ids must keep rows and columns apart
L, D, P = 5, 32, 32  # text tokens, the T5 states' width, the pooled CLIP width
U = [0.0004, 0.03, 0.31, 0.5, 0.77, 0.9993]  # the script's u: both ends of the table and between
GUIDANCE = 3.5  # the script's --guidance_scale default, diffrelay's model.kwargs.guidance default
TRANSFORMER = {"patch_size": 1, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
               "num_attention_heads": 2, "axes_dims_rope": (2, 2, 4)}  # in_channels 4C, D, P: set by build_flux
DEV = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
       "max_image_seq_len": 4096}
# (scheduler config, guidance_embeds, with_prior_preservation)
CASES = {"dev": (DEV, True, False), "schnell": ({"shift": 1.0, "use_dynamic_shifting": False}, False, False),
         "dev-prior": (DEV, True, True)}
PRIOR_WEIGHT = 0.7  # --prior_loss_weight of the prior case (not 1, so a dropped weight shows)
BOUNDS = {"x_t": 1e-6, "time": 1e-6, "ids": 0.0,  # max abs
          "loss": 1e-6,  # relative: float32 losses, summed per sample (the script) or at once (ours) (1.0e-7)
          "rounding": 1.001e-3,  # |sigma - (1 - u)|: at most one table step (1e-3), plus float32's rounding of u
          "table": 1e-6}  # the scheduler's float32 sigma table against (1000 - i) / 1000 in float64 (max abs)
READ = ("vae_scale_factor", "latent_image_ids")  # assigned before FIRST in the script, read by its loss lines
VAE_BLOCKS = [8, 16]  # vae_config_block_out_channels: scale factor 2 ** (len - 1) = 2


def statements(path: Path, prior: bool = False):
    """(get_sigmas' definition, the loss statements) of the script, with the READ assignments made before them;
    `prior`: on to the statement before accelerator.backward (the prior loss added to the instance loss)."""
    get_sigmas, block, first, last = accumulate_block(path)
    end = last + 1
    if prior:
        end = next((i for i in range(end, len(block)) if "backward" in ast.unparse(block[i])), end)
    lines = block[first:end]

    def assigns(st) -> set:
        return {t.id for t in ast.walk(st) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)} \
            if isinstance(st, (ast.Assign, ast.AnnAssign)) else set()

    earlier = [st for st in block[:first] if assigns(st) & set(READ)]
    found = set().union(*map(assigns, earlier + lines))
    if not set(READ) <= found:
        raise SystemExit(f"{path}: the accumulate block assigns no {sorted(set(READ) - found)}")
    return get_sigmas, earlier + lines


def transformer(diffusers, guidance_embeds: bool):
    """The script side's tiny FluxTransformer2DModel, seeded (ours loads its state dict)."""
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(in_channels=4 * C, joint_attention_dim=D, pooled_projection_dim=P,
                                            guidance_embeds=guidance_embeds, **TRANSFORMER).eval()


def recording(model) -> dict:
    """What `model` is called with, by its forward's argument names, recorded at each call."""
    seen, signature = {}, inspect.signature(model.forward)

    def hook(module, args, kwargs):
        seen.update({"guidance": None, **signature.bind(*args, **kwargs).arguments})

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def script_loss(diffusers, path: Path, model, x0, noise, u, text: Text, scheduler: dict, prior: bool = False):
    """The script's loss, the inputs its transformer saw, its sigmas and the sigma table it indexed; `prior`: with
    --with_prior_preservation, the batch's second half the class images."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    get_sigmas, body = statements(path, prior)
    seen = recording(model)
    fake = types.ModuleType("torch")
    fake.__getattr__ = lambda name: getattr(torch, name)
    fake.randn_like = lambda x, **kw: noise.clone()
    args = types.SimpleNamespace(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                 guidance_scale=GUIDANCE, with_prior_preservation=prior,
                                 prior_loss_weight=PRIOR_WEIGHT)
    ns = {"torch": fake, "args": args, "model_input": x0.clone(), "transformer": model, "unwrap_model": lambda m: m,
          "noise_scheduler_copy": diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **scheduler),
          "accelerator": types.SimpleNamespace(device=torch.device("cpu")), "FluxPipeline": diffusers.FluxPipeline,
          "vae_config_block_out_channels": VAE_BLOCKS, "weight_dtype": torch.float32,
          "prompt_embeds": text.states.clone(), "pooled_prompt_embeds": text.pooled.clone(),
          "text_ids": torch.zeros(text.states.shape[1], 3),  # the script's encode_prompt: zeros(L, 3)
          "compute_loss_weighting_for_sd3": compute_loss_weighting_for_sd3,
          "compute_density_for_timestep_sampling": lambda **kw: u.clone()}
    exec(compile(ast.Module([get_sigmas], []), str(path), "exec"), ns)
    for st in body:
        exec(compile(ast.Module([st], []), str(path), "exec"), ns)
    return ns["loss"], seen, ns["sigmas"].flatten(), ns["noise_scheduler_copy"].sigmas


def maxabs(a, b) -> float:
    """Max abs difference; inf when the shapes differ or one side is missing."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def listed(x):
    return None if x is None else [float(v) for v in x.flatten()]


def main() -> None:
    a, path = script_command(__doc__, "train_dreambooth_lora_flux.py", "diffusers_flux_loss.json")
    t0 = time.perf_counter()
    diffusers = import_diffusers(a.diffusers_src)
    g = Gate()
    g.equal("script found", path.exists(), True)
    results = {}
    g_ = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(B, C, H, W, generator=g_), torch.randn(B, C, H, W, generator=g_)
    text = Text(torch.randn(B, L, D, generator=g_), torch.ones(B, L, dtype=torch.int64),
                torch.randn(B, P, generator=g_))
    u = torch.tensor(U)
    grid = torch.arange(1000, 0, -1, dtype=torch.float64) / 1000
    for case, (scheduler, guidance_embeds, prior) in CASES.items() if path.exists() else []:
        theirs_model = transformer(diffusers, guidance_embeds)
        with torch.no_grad():
            theirs, seen, sigma, table = script_loss(diffusers, path, theirs_model, x0, noise, u, text, scheduler,
                                                     prior)
        net = flux_family.FAMILY.build(resolution=H, in_channels=C, num_classes=0, text={"states": D, "length": L,
                                       "pooled": P}, guidance=GUIDANCE, guidance_embeds=guidance_embeds, **TRANSFORMER)
        net.model.load_state_dict(theirs_model.state_dict())
        ours_seen = recording(net.model.eval())
        st = flow.TrainSettings("uniform", shift=1.0)
        with torch.no_grad():
            # prior: the row weights diffrelay's loader gives a batch of instance then regularisation rows
            weights = torch.from_numpy(subsets.prior_weights(B, PRIOR_WEIGHT)) if prior else None
            ours = flow.loss(flow.VelocityModel(net), x0, text, torch.special.ndtri(sigma.double()).float(), noise, st,
                             weights=weights)
        figures = {"x_t": maxabs(ours_seen.get("hidden_states"), seen.get("hidden_states")),
                   "time": maxabs(ours_seen.get("timestep"), seen.get("timestep")),
                   "ids": max(maxabs(ours_seen.get("img_ids"), seen.get("img_ids")),
                              maxabs(ours_seen.get("txt_ids"), seen.get("txt_ids"))),
                   "loss": abs(float(ours) - float(theirs)) / abs(float(theirs)),
                   "rounding": float((sigma.double() - (1 - u.double())).abs().max()),
                   "table": maxabs(table, grid)}
        for key, value in figures.items():
            g.at_most(f"{key}/{case}", value, BOUNDS[key])
        guidance = {"ours": listed(ours_seen.get("guidance")), "diffusers": listed(seen.get("guidance"))}
        g.equal(f"guidance/{case}", guidance["ours"], guidance["diffusers"])
        results[case] = {"ours": float(ours), "diffusers": float(theirs), **figures, "guidance": guidance}
    worst = g.worst()
    print("max differences:", {k: f"{v:.2e}" for k, v in worst.items()})
    write_results(a.out, "diffrelay's flow loss (train.flow uniform, shift 1) with its FLUX network (families.flux "
                  "flux) against diffusers' train_dreambooth_lora_flux.py", diffusers=diffusers.__version__,
                  diffusers_file=diffusers.__file__, script=str(path), bounds=BOUNDS, max_by_kind=worst,
                  cases=results, seconds=round(time.perf_counter() - t0, 1), gate=g.to_json())
    g.finish("check_diffusers_flux_loss")


if __name__ == "__main__":
    main()
