"""Objectives: what the network is trained to predict and how images are drawn from it. Each objective
owns its preconditioning, training loss, noise/time draws and samplers: `edm` (Karras et al. 2022),
`flow` (flow matching, linear interpolant, velocity prediction) and `ddpm` (DiT's 1000-step noise prediction
with learned sigma). `model.objective` picks one.

Imports the base modules, nets and text (a Text travels where labels do).
"""


def objective(model_cfg: dict) -> str:
    """model.objective of a `model` section; sections from before it existed are EDM's."""
    return model_cfg.get("objective", "edm")


def build(model_cfg: dict, resolution: int, num_classes: int, in_channels: int = 3, text: dict | None = None):
    """The network of a `model` section wrapped as its objective wants: EDM's Denoiser, flow's VelocityModel or
    ddpm's EpsModel. All take (x, time, labels); what `time` means is the objective's (see each module). `text`:
    the text dims of a text run (text.source.TextSource.dims), given to the network's builder."""
    from diffrelay.nets import registry
    from diffrelay.objectives import ddpm, edm, flow
    from diffrelay import nets

    extra = {"text": text} if text else {}  # only text runs: builders from before text keep their call
    if objective(model_cfg) == "edm":
        return edm.build(model_cfg, resolution, num_classes, in_channels, **extra)
    arch, kwargs = nets.arch_kwargs(model_cfg)
    classes = num_classes if model_cfg["class_conditional"] else 0
    net = registry.build_network(arch, kwargs, resolution, in_channels, classes, **extra)
    return ddpm.EpsModel(net, in_channels) if objective(model_cfg) == "ddpm" else flow.VelocityModel(net)


def sample(model_cfg: dict, net, latents, labels, num_steps: int, solver: str, edm_settings, flow_settings,
           noise, unguided=None, interval=None, ddpm_settings=None):
    """Draw images with the objective's sampler (edm: heun/euler with churn; flow: euler/heun/sde;
    ddpm: ddpm/ddim)."""
    from diffrelay.objectives import ddpm, edm, flow

    kind = objective(model_cfg)
    if kind == "edm":
        return edm.sample(net, latents, labels, num_steps, solver, edm_settings, noise, unguided, interval)
    if kind == "ddpm":
        return ddpm.sample(net, latents, labels, num_steps, solver, ddpm_settings or ddpm.SamplerSettings(), noise,
                           unguided, interval, ddpm.Options.of(model_cfg.get("ddpm")))
    return flow.sample(net, latents, labels, num_steps, solver, flow_settings, noise, unguided, interval)


def noise_offset(cfg) -> float:
    """model.ddpm.noise_offset of a Config (0 where the section is absent): the loader adds the offset's draw."""
    from diffrelay.objectives.ddpm_options import Options

    return Options.of(getattr(cfg.model, "ddpm", None)).noise_offset


def loss(cfg, net, images, labels, rnd_normal, noise, augment_labels=None, weights=None):
    """The training loss of cfg's objective (a Config) at the caller's standard normal draws: one per sample
    (EDM's ln sigma, flow's time) and the noise images; augment_labels those of EDM's augmentation pipe (edm only);
    weights a sample's weight (prior preservation, objectives/reduce.py) or None. The training loop calls this and
    nothing else."""
    from diffrelay.objectives import ddpm, edm, flow

    t = cfg.train
    if cfg.model.objective == "ddpm":
        out = ddpm.loss(net, images, labels, rnd_normal, noise, ddpm.Options.of(getattr(cfg.model, "ddpm", None)),
                        weights=weights)
    elif cfg.model.objective == "flow":
        out = flow.loss(net, images, labels, rnd_normal, noise, flow.TrainSettings(**cfg.to_dict()["train"]["flow"]),
                        weights=weights)
    else:  # edm2's network learns its uncertainty u(sigma), and edm2's loss weights by it (nets/edm2.py).
        out = edm.loss(net, images, labels, rnd_normal, noise, t.p_mean, t.p_std, cfg.model.sigma_data,
                       uncertainty=cfg.model.arch == "edm2", augment_labels=augment_labels, weights=weights)
    # Each objective returns the mean over every element. train.loss_reduction sum is EDM's and edm2's: a sample's
    # loss summed over its C x H x W elements, averaged over the batch (NVlabs/edm training/training_loop.py:132,
    # loss.sum() / batch_gpu_total, then DDP's average over ranks): the mean times the elements of a sample.
    return out * images[0].numel() if t.loss_reduction == "sum" else out
