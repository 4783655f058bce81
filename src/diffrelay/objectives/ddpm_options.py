"""model.ddpm: the discrete-time objective as diffusers' schedulers and training scripts define it, checked
without torch. Names follow diffusers: DDPMScheduler's beta_schedule, beta_start, beta_end, prediction_type and
rescale_betas_zero_snr (schedulers/scheduling_ddpm.py), and the training scripts' --snr_gamma and --noise_offset
(examples/text_to_image/train_text_to_image.py). Which values are refused (check_config, when a config is read)
and how the section enters a run's trajectory (trajectory: only keys away from their defaults, so a run from
before the section existed keeps its identity). The arithmetic is objectives/ddpm.py's.

Imports the base modules only.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Options:
    """The defaults are DiT's objective, the one objectives/ddpm.py trained before these keys existed."""

    beta_schedule: str = "linear"  # linear | scaled_linear (linspace of sqrt(beta), squared: Stable Diffusion's)
    beta_start: float = 0.0001
    beta_end: float = 0.02
    prediction_type: str = "epsilon"  # epsilon | v_prediction | sample (x0)
    rescale_betas_zero_snr: bool = False  # Lin et al. 2024, Algorithm 1: abar at the last timestep is 0
    snr_gamma: float | None = None  # min-SNR-gamma loss weights (Hang et al. 2023); None = unweighted
    noise_offset: float = 0.0  # noise + offset * N(0, 1) per sample and channel (Guttenberg 2023)

    @classmethod
    def of(cls, section) -> "Options":
        """From a model.ddpm section (a dict, a config.Config or None: absent means the defaults)."""
        section = section.to_dict() if hasattr(section, "to_dict") else (section or {})
        return cls(**section)

    def schedule(self) -> tuple:
        """What the noise schedule depends on (a cache key of objectives/ddpm.py's tables)."""
        return self.beta_schedule, self.beta_start, self.beta_end, self.rescale_betas_zero_snr

    def sampled(self) -> tuple:
        """What sampling reads: the schedule and what the network predicts (a guide must share them)."""
        return (*self.schedule(), self.prediction_type)


DEFAULT = Options()
LATENT_CHANNELS = 4  # the SD-VAE's latents (data.encoder sd-vae*)


def changed(section) -> dict:
    """The keys of a model.ddpm section that differ from their defaults."""
    return {k: v for k, v in (section or {}).items() if getattr(DEFAULT, k, None) != v}


def trajectory(kind: str, model: dict, train: dict) -> None:
    """Each objective's own keys in a trajectory (in place): train.flow in flow runs, and model.ddpm's keys away
    from their defaults in ddpm runs (a config that writes the defaults out is the same run as one that does not)."""
    if kind != "flow":
        train.pop("flow", None)
    elif not (train.get("flow") or {}).get("precondition_outputs", True):
        train["flow"] = {k: v for k, v in train["flow"].items() if k != "precondition_outputs"}  # runs before it
    keys = changed(model.pop("ddpm", None))
    if kind == "ddpm" and keys:
        model["ddpm"] = keys


def _image_channels(d: dict) -> int | None:
    encoder = d["data"]["encoder"]
    return 3 if encoder == "none" else LATENT_CHANNELS if encoder.startswith("sd-vae") else None


def check_config(d: dict) -> list[tuple[str, str]]:
    """(key, message) pairs for a validated-by-schema config; empty when all is well."""
    m = d["model"]
    o = Options.of(m.get("ddpm"))
    keys = changed(m.get("ddpm"))
    if keys and m["objective"] != "ddpm":
        key = sorted(keys)[0]
        return [(f"model.ddpm.{key}={keys[key]}", "applies to model.objective ddpm only; set model.objective: ddpm, "
                 "or drop it")]
    bad = []
    if o.beta_end <= o.beta_start:
        bad.append((f"model.ddpm.beta_end={o.beta_end}", f"must be greater than model.ddpm.beta_start={o.beta_start} "
                    "(betas grow with the timestep); e.g. 0.0001 and 0.02 (linear) or 0.00085 and 0.012 "
                    "(scaled_linear, Stable Diffusion)"))
    if o.rescale_betas_zero_snr and o.prediction_type == "epsilon":
        bad.append(("model.ddpm.rescale_betas_zero_snr=true", "leaves no signal at the last timestep (abar = 0), "
                    "where a noise prediction says nothing about the image (Lin et al. 2024, Sec. 3.2); set "
                    "model.ddpm.prediction_type: v_prediction (or sample)"))
    out, channels = m.get("kwargs", {}).get("out_channels"), _image_channels(d)
    if o.prediction_type == "sample" and out is not None and channels is not None and out == 2 * channels:
        bad.append((f"model.kwargs.out_channels={out}", f"DiT's learned sigma (L_vlb) is defined for "
                    f"prediction_type epsilon and v_prediction; with model.ddpm.prediction_type {o.prediction_type} set "
                    f"out_channels: {channels} (or drop it)"))
    return bad
