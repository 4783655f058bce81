"""The `sample` section as sampling uses it (Settings): what changes the pixels, and the sampler flags.

Imports the base modules and objectives (each objective's sampler settings).
"""

import dataclasses

from diffrelay.errors import UserError
from diffrelay.objectives.edm import SamplerSettings
from diffrelay.objectives.flow import SamplerSettings as FlowSamplerSettings

PIXEL_KEYS = ("num_images", "first_seed", "steps", "solver", "weights", "class_labels", "precision", "compile",
              "guidance")
# sample.edm keys and their `diffrelay sample` flags (argparse attribute names).
EDM_FLAGS = {"sigma_min": "sigma_min", "sigma_max": "sigma_max", "rho": "rho", "S_churn": "s_churn",
             "S_min": "s_min", "S_max": "s_max", "S_noise": "s_noise"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The schema's `sample` section, minus nproc (the process count comes from torchrun)."""

    num_images: int
    first_seed: int
    steps: int
    solver: str  # heun | euler
    batch_size: int  # images per forward pass per process, before padding to PAD_ROWS
    weights: str  # ema | raw
    class_labels: str | int  # "balanced" or one class index
    precision: str  # fp32 | bf16
    threads: int
    compile: bool = False  # torch.compile the network (one shape: forward_rows)
    edm: SamplerSettings = SamplerSettings()  # sample.edm: schedule and churn
    flow: FlowSamplerSettings = FlowSamplerSettings()  # sample.flow: grid shift and the sde's last step
    guidance_interval: tuple | None = None  # (lo, hi) noise levels where guidance applies; None = every step
    guidance: float = 1.0  # classifier-free guidance scale; 1 = off (one network pass, as without guidance)
    guide: str | None = None  # autoguidance: the guiding snapshot's path; None = the null class (CFG)

    @classmethod
    def from_section(cls, section: dict) -> "Settings":
        values = {f.name: section[f.name] for f in dataclasses.fields(cls)}
        values["edm"] = SamplerSettings(**values["edm"])
        values["flow"] = FlowSamplerSettings(**values["flow"])
        values["guidance_interval"] = None if values["guidance_interval"] is None else tuple(values["guidance_interval"])
        g = values["guidance"]
        if isinstance(g, list):  # a sweep: the workflow passes one value a job with --guidance
            if len(g) > 1:
                raise UserError(f"sample.guidance={g}: a list; pass one value with --guidance")
            values["guidance"] = g[0]
        values["guidance"] = float(values["guidance"])
        return cls(**values)
