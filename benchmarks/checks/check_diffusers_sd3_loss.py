"""Our flow-matching loss (diffrelay.objectives.flow, train.flow) against the loss lines of diffusers'
train_dreambooth_lora_sd3.py, on the same latents, noise and times.

  python benchmarks/checks/check_diffusers_sd3_loss.py --diffusers-src /path/to/diffusers/src

--diffusers-src is the `src` folder of a diffusers checkout; diffusers is imported from there. The script is read
from <src>/../examples/dreambooth/train_dreambooth_lora_sd3.py (or --script). Nothing of diffusers enters the package.

The script's lines are taken with `ast`: its nested get_sigmas, and the statements of the `accelerator.accumulate`
block from `noise = torch.randn_like(model_input)` to the first `loss = loss.mean()`, executed in a namespace holding
args, a FlowMatchEulerDiscreteScheduler (noise_scheduler_copy) with the case's shift, diffusers' own
compute_loss_weighting_for_sd3, the latents, and a network that is a fixed function of its input and timestep. Its
time draw (compute_density_for_timestep_sampling) returns the case's u, and torch.randn_like the case's noise.
The script rounds u to one of the scheduler's 1000 sigmas (indices = (u * 1000).long()); ours is handed the normal
draw whose time, sigmoid(mean + std n) shifted, is that sigma (the shift and sigmoid inverted in float64), so both
see the same x_t and time; the time's rounding itself is reported (rounding/*: |sigma - shift(1 - u)|, the
distance from the continuous time diffrelay draws).

Cases: logit_normal (mean 0, std 1), precondition_outputs 1 (the script's default: the x0 loss) and 0 (the velocity
loss), shift 3.0 (SD3-medium's scheduler) and 1.0. Compared: the x_t each network sees (max abs), its time input
(ours t x 1000 against the script's timesteps, max abs) and the loss (relative); and shift/*: the sigma table the
script's lines index (noise_scheduler_copy.sigmas, FlowMatchEulerDiscreteScheduler's 1000 shifted sigmas) against
SD3's shift written out here, sigma' = shift sigma / (1 + (shift - 1) sigma) on the grid sigma = (1000 - i) / 1000
(Esser et al. 2024's resolution-dependent shift of the timesteps), in float64 (max abs). A wrong shift moves the
x_t and the time of both sides alike (ours is handed the script's sigma), so without shift/* it showed only through
rounding/*, whose bound is a table step. Bounds: BOUNDS; exit status 1 with one FAIL line per figure outside its
bound. Writes benchmarks/results/diffusers_sd3_loss.json.
tests/test_flow_sd3_loss.py runs it against the installed diffusers and a stand-in script.
"""

import ast
import itertools
import time
import types
from pathlib import Path

import torch
from official import Gate, script_command, write_results

from check_diffusers_objective import import_diffusers
from diffrelay.objectives import flow

B, C, RES = 6, 4, 4
U = [0.0004, 0.03, 0.31, 0.5, 0.77, 0.9993]  # the script's u: both ends of the table and between
BOUNDS = {"x_t": 1e-6, "time": 1e-3, "loss": 2e-5,  # max abs; the time input x 1000; relative (float32 losses)
          "rounding": 1.5e-3,  # |sigma - shift(1 - u)|: at most one table step (1e-3), stretched by the shift
          "shift": 1e-6}  # the scheduler's float32 sigma table against the shift formula in float64 (max abs)
FIRST, LAST = "noise = torch.randn_like(model_input)", "loss = loss.mean()"


def statements(path: Path):
    """(get_sigmas' definition, the loss statements) of the script."""
    get_sigmas, block, first, last = accumulate_block(path)
    return get_sigmas, block[first:last + 1]


def accumulate_block(path: Path):
    """(get_sigmas' definition, the statements of the script's `with accelerator.accumulate(...)` block, the
    indices of FIRST and LAST among them); the FLUX script's check reads the same parts."""
    tree = ast.parse(path.read_text())
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "get_sigmas"]
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.With)
              and any("accumulate" in ast.unparse(i.context_expr) for i in n.items)]
    if len(defs) != 1 or len(blocks) != 1:
        raise SystemExit(f"{path}: expected one get_sigmas and one `with accelerator.accumulate(...)` block, found "
                         f"{len(defs)} and {len(blocks)}")
    body = [ast.unparse(s) for s in blocks[0].body]
    if FIRST not in body or LAST not in body:
        raise SystemExit(f"{path}: the accumulate block has no `{FIRST}` or no `{LAST}`")
    return defs[0], blocks[0].body, body.index(FIRST), body.index(LAST)


def velocity(x, timestep):
    """The network of both sides: a fixed, time-dependent function (timestep in the script's 0..1000)."""
    t = timestep.reshape(-1, 1, 1, 1).to(x.dtype) / 1000
    return torch.tanh(0.7 * x) - 0.3 * x * t + t


def shifted(shift: float, n: int = 1000) -> torch.Tensor:
    """SD3's timestep shift (Esser et al. 2024; diffusers' FlowMatchEulerDiscreteScheduler) of the n-step grid
    sigma = 1, (n - 1) / n, ..., 1 / n: shift sigma / (1 + (shift - 1) sigma), in float64."""
    sigma = torch.arange(n, 0, -1, dtype=torch.float64) / n
    return shift * sigma / (1 + (shift - 1) * sigma)


def script_loss(diffusers, path: Path, x0, noise, u, shift: float, precondition: int):
    """The script's loss, the x_t and timesteps its network saw, its sigmas and the sigma table it indexed."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    get_sigmas, body = statements(path)
    seen = {}

    def transformer(hidden_states, timestep, **kw):
        seen["x_t"], seen["timestep"] = hidden_states, timestep
        return (velocity(hidden_states, timestep),)

    fake = types.ModuleType("torch")
    fake.__getattr__ = lambda name: getattr(torch, name)
    fake.randn_like = lambda x, **kw: noise.clone()
    args = types.SimpleNamespace(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                 precondition_outputs=precondition, with_prior_preservation=False)
    ns = {"torch": fake, "args": args, "model_input": x0.clone(), "transformer": transformer,
          "noise_scheduler_copy": diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
          "accelerator": types.SimpleNamespace(device=torch.device("cpu")), "prompt_embeds": None,
          "pooled_prompt_embeds": None, "compute_loss_weighting_for_sd3": compute_loss_weighting_for_sd3,
          "compute_density_for_timestep_sampling": lambda **kw: u.clone()}
    exec(compile(ast.Module([get_sigmas], []), str(path), "exec"), ns)
    for st in body:
        exec(compile(ast.Module([st], []), str(path), "exec"), ns)
    return ns["loss"], seen, ns["sigmas"].flatten(), ns["noise_scheduler_copy"].sigmas


def normal_for(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The standard normal n whose time, shift(sigmoid(n)) (train.flow time lognormal, mean 0, std 1), is sigma."""
    s = sigma.double()
    unshifted = s / (shift - (shift - 1) * s)
    return torch.log(unshifted / (1 - unshifted))


def main() -> None:
    a, path = script_command(__doc__, "train_dreambooth_lora_sd3.py", "diffusers_sd3_loss.json")
    t0 = time.perf_counter()
    diffusers = import_diffusers(a.diffusers_src)
    g = Gate()
    g.equal("script found", path.exists(), True)
    results = {}
    g_ = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(B, C, RES, RES, generator=g_), torch.randn(B, C, RES, RES, generator=g_)
    u = torch.tensor(U)
    for shift, precondition in itertools.product((3.0, 1.0), (1, 0)) if path.exists() else []:
        case = f"shift{shift:g}-precondition{precondition}"
        theirs, seen, sigma, table = script_loss(diffusers, path, x0, noise, u, shift, precondition)
        ours_seen = {}

        def net(x_t, t, labels):
            ours_seen["x_t"], ours_seen["t"] = x_t, t
            return velocity(x_t, t * 1000)

        st = flow.TrainSettings("lognormal", 0.0, 1.0, shift, precondition_outputs=bool(precondition))
        ours = flow.loss(net, x0, None, normal_for(sigma, shift).float(), noise, st)
        figures = {"x_t": float((ours_seen["x_t"] - seen["x_t"]).abs().max()),
                   "time": float((ours_seen["t"].flatten() * 1000 - seen["timestep"].float()).abs().max()),
                   "loss": abs(float(ours) - float(theirs)) / abs(float(theirs)),
                   "rounding": float((sigma.double() - flow.shift_time(1 - u.double(), shift)).abs().max()),
                   "shift": float((table.double() - shifted(shift)).abs().max()) if len(table) == 1000 else 1.0}
        for key, value in figures.items():
            g.at_most(f"{key}/{case}", value, BOUNDS[key])
        results[case] = {"ours": float(ours), "diffusers": float(theirs), **figures}
    worst = g.worst()
    print("max differences:", {k: f"{v:.2e}" for k, v in worst.items()})
    write_results(a.out, "diffrelay's flow loss (train.flow lognormal, precondition_outputs) against diffusers' "
                  "train_dreambooth_lora_sd3.py", diffusers=diffusers.__version__, diffusers_file=diffusers.__file__,
                  script=str(path), bounds=BOUNDS, max_by_kind=worst, cases=results,
                  seconds=round(time.perf_counter() - t0, 1), gate=g.to_json())
    g.finish("check_diffusers_sd3_loss")


if __name__ == "__main__":
    main()
