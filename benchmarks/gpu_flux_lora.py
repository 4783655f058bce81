"""Issue 56's GPU figure: one LoRA step of a FLUX.1-dev-size transformer at 1024 px, base int8 and base bf16.

  python3 tools/gpu_bundle.py --with-lora            # here, once: build/gpu-bundle-lora.tar.xz (peft, torchao, ...)
  python3 benchmarks/gpu_flux_lora.py --bundle build/gpu-bundle-lora.tar.xz --out "$OUT/gpu_flux_lora.json" \\
      --budget 300                                   # there, with build/gpu-bundle-lora.tar.xz carried
  python3 benchmarks/gpu_flux_lora.py --cpu-check    # here: the same code path, a tiny config, on the CPU

The network is diffusers' FluxTransformer2DModel built from FLUX.1-dev's published transformer config
(11,901,408,320 parameters, asserted) with random weights: built on the meta device, cast to bf16 there, then
materialised on the GPU one block at a time (to_empty, then a seeded normal init: std 1/sqrt(fan_in) for matrices,
ones for norm weights, zeros for biases), so no fp32 copy of 12 B parameters is ever made, on the host or the GPU.
Per case, in its own process (a fresh CUDA peak, the model freed with the process):

  int8   torchao's quantize_(..., Int8WeightOnlyConfig()) on every nn.Linear, applied to each block right after it is
         materialised (the same layers quantize_(model) picks; the bf16 copy of the whole model never exists), then
         the remaining top-level layers (embedders, norm_out, proj_out) at once;
  none   the bf16 base as it is.

Then peft's inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", the twelve target
modules of diffusers' train_dreambooth_lora_flux.py)), as diffrelay's pretrained/lora.py attach does; the base
frozen, the adapter cast to fp32 (diffusers' cast_training_params); enable_gradient_checkpointing(); AdamW (lr 1e-4)
on the adapter alone, or the case's train.optimizer as diffrelay builds it (issue 68: int8/ao_adamw8bit,
none/prodigy, ...; /fused steps each adapter tensor from its gradient hook, training/fused_backward.py). Precision: bf16 base weights, fp32 adapter and optimizer state, the forward under bf16
autocast, the loss in fp32. A step: batch 1 at 1024 px, i.e. latents 16 x 128 x 128 packed 2 x 2 into (1, 4096, 64)
tokens with FluxPipeline's image ids (as diffrelay's families/flux.py call), 512 text tokens of random T5 states
(1, 512, 4096) with zero ids, a pooled (1, 768) vector, guidance 3.5, t ~ U(0, 1) (the transformer multiplies
timestep and guidance by 1000 itself), x_t = (1 - t) x0 + t noise, velocity target noise - x0, MSE.

Figures per case: peak_gib (torch.cuda.max_memory_allocated over the whole case process, setup included;
setup_peak_gib and train_peak_gib split it, the counter reset between them), reserved_peak_gib, s_per_step (median
after one warm-up step), params (the base's), trainable (the adapter's), the losses. Each case catches its own
failure (an unsupported int8 kernel, out of memory) and records it; no case starts past --budget seconds and a
running one is stopped at it (the steps already timed are kept). The JSON is rewritten after each case.
Exits 2 with one line where there is no CUDA device (unless --cpu-check).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import torch  # the machine's own; diffusers, peft, transformers, torchao come from the bundle

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "gpu_flux_lora.json"
DEFAULT_BUNDLE = ROOT / "build" / "gpu-bundle-lora.tar.xz"

# black-forest-labs/FLUX.1-dev, transformer/config.json
FLUX_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
            "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}
FLUX_DEV_PARAMS = 11_901_408_320
# --cpu-check: the same layers, tiny (head dim 8 = 2 + 2 + 4 of the rope axes), on a 16 x 16 latent
TINY = {**FLUX_DEV, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2,
        "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (2, 2, 4)}
SHAPES = {"full": {"latent": 128, "text_tokens": 512}, "tiny": {"latent": 16, "text_tokens": 8}}
LATENT_CHANNELS = 16  # FLUX's VAE; packed 2 x 2 into in_channels 64
# diffusers' examples/dreambooth/train_dreambooth_lora_flux.py, its default target_modules (--lora_layers unset)
TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
           "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
           "ff_context.net.2"]
RANK, ALPHA, GUIDANCE, LR = 4, 4, 3.5, 1e-4
QUANTS = ("int8", "none")
# train.optimizer choices a case may name (issue 68); adamw8bit and lion8bit need bitsandbytes, which the bundle
# leaves out (its CUDA builds alone would fill the 64 MiB): they fail in one recorded line where it is missing.
OPTIMIZERS = ("adamw", "adamw8bit", "lion8bit", "ao_adamw8bit", "ao_adamw4bit", "ao_adamw_fp8", "prodigy", "adafactor",
              "schedulefree_adamw")
GIB = 2 ** 30


# ---------------------------------------------------------------- one case (its own process)

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(n) -> float | None:
    return None if n is None else round(n / GIB, 3)


def init_(module, gen) -> None:
    """Seeded random weights in place: matrices N(0, 1/fan_in), norm weights 1, biases 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def build(config: dict, device, quant: str, seed: int = 0, swap: int = 0):
    """FluxTransformer2DModel(**config) with random bf16 weights on `device`, int8 weight-only where quant == int8;
    the last `swap` blocks (in the order they run) moved to the host once made (train.block_swap parks them there,
    runtime/block_swap.py copies them in): the same weights, so a swapped case's losses are the unswapped one's.
    Returns (model, base parameter count)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    params = sum(p.numel() for p in model.parameters())
    model.to(dtype=torch.bfloat16)  # on meta: no memory
    if quant == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = {"transformer_blocks", "single_transformer_blocks"}
    order = [*model.transformer_blocks, *model.single_transformer_blocks]
    parked = {id(b) for b in order[len(order) - swap:]} if swap else set()
    for name in sorted(blocks):
        for block in getattr(model, name):  # one block in bf16 at a time, quantized before the next
            block.to_empty(device=device)
            init_(block, gen)
            if quant == "int8":
                quantize_(block, Int8WeightOnlyConfig())
            if id(block) in parked:
                block.to("cpu")
    for name, child in model.named_children():
        if name not in blocks:
            child.to_empty(device=device)
            init_(child, gen)
    if quant == "int8":  # the top-level layers (embedders, norm_out, proj_out): quantize_(model) less the blocks
        quantize_(model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn.split(".")[0] not in blocks)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"not materialised: {left[:5]}"
    return model, params


def attach_lora(model) -> list:
    """peft's LoRA on TARGETS (inject_adapter_in_model, what diffusers' add_adapter calls), base frozen, adapter
    in fp32; its parameters."""
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights="gaussian", target_modules=TARGETS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inject_adapter_in_model(config, model)
    trainable = []
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
            trainable.append(p)
    return trainable


def batch(config: dict, shape: dict, device, seed: int = 1) -> dict:
    """One 1024 px example (tiny: 128 px): packed x_t, its velocity target, text states, ids, t, guidance."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = w = shape["latent"]
    c = LATENT_CHANNELS

    def pack(x):  # families/flux.py call: (B, C, H, W) -> (B, H/2 x W/2, 4C)
        b = x.shape[0]
        return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)

    x0 = torch.randn(1, c, h, w, device=device, generator=g)
    noise = torch.randn(1, c, h, w, device=device, generator=g)
    t = torch.rand(1, device=device, generator=g)
    ids = torch.zeros(h // 2, w // 2, 3, device=device)  # FluxPipeline._prepare_latent_image_ids: (0, row, column)
    ids[..., 1] += torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] += torch.arange(w // 2, device=device)[None, :]
    n = shape["text_tokens"]
    bf = torch.bfloat16
    return {"hidden_states": pack((1 - t) * x0 + t * noise).to(bf), "target": pack(noise - x0),
            "encoder_hidden_states": torch.randn(1, n, config["joint_attention_dim"], device=device,
                                                 generator=g).to(bf),
            "pooled_projections": torch.randn(1, config["pooled_projection_dim"], device=device, generator=g).to(bf),
            "timestep": t.to(bf), "guidance": torch.full((1,), GUIDANCE, device=device),
            "img_ids": ids.reshape(-1, 3).to(bf), "txt_ids": torch.zeros(n, 3, device=device, dtype=bf)}


def parse_case(case: str) -> tuple[str, str, bool, int]:
    """"int8", "none/ao_adamw8bit", "int8/adamw/fused", "none/swap16" -> (quantize_base, train.optimizer,
    train.fused_backward, train.block_swap)."""
    quant, *rest = case.split("/")
    names = [p for p in rest if p in OPTIMIZERS]
    swaps = [p for p in rest if p.startswith("swap") and p[4:].isdigit()]
    fused = "fused" in rest
    if quant not in QUANTS or len(names) > 1 or len(swaps) > 1 or len(rest) != len(names) + len(swaps) + fused:
        raise ValueError(f"{case}: want QUANT[/OPTIMIZER][/fused][/swapN], QUANT in {QUANTS}, OPTIMIZER in "
                         f"{OPTIMIZERS}, N the blocks train.block_swap keeps on the host")
    return quant, (names or ["adamw"])[0], fused, int(swaps[0][4:]) if swaps else 0


def make_optimizer(name: str, trainable: list, fused: bool):
    """train.optimizer `name` over the adapter as diffrelay builds it (training/optimizers.py: the library's class,
    lr / betas / weight_decay as diffrelay passes them, prodigy at lr 1.0), per parameter on its gradient hook for
    train.fused_backward (training/fused_backward.py). adamw: torch's AdamW at LR, as this benchmark always had."""
    import types

    sys.path.insert(0, str(ROOT / "src"))
    from diffrelay.training import fused_backward, optimizers

    t = types.SimpleNamespace(lr=1.0 if name == "prodigy" else LR, betas=(0.9, 0.999), weight_decay=0.0,
                              warmup_steps=0, optimizer_args={})

    def one(params):
        if name == "adamw":
            return torch.optim.AdamW(params, lr=LR)
        opt = optimizers.optimizer_class(name)(params, **optimizers.kwargs(t, optimizers.CHOICES[name]))
        if name == "schedulefree_adamw":
            opt.train()
        return opt

    return fused_backward.PerParameter(trainable, one) if fused else one(trainable)


def run_case(case: str, config: dict, shape: dict, device, steps: int, deadline: float) -> dict:
    quant, name, fused, swap = parse_case(case)
    out = {"quantize_base": None if quant == "none" else quant, "optimizer": name, "fused_backward": fused,
           "block_swap": swap}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model, params = build(config, device, quant, swap=swap)
    out["params"] = params
    if config == FLUX_DEV:
        assert params == FLUX_DEV_PARAMS, f"{params} parameters, FLUX.1-dev's transformer has {FLUX_DEV_PARAMS}"
    trainable = attach_lora(model)
    out["trainable"] = sum(p.numel() for p in trainable)
    out["lora_layers"] = sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))
    if swap:  # as training/state.py: parked, the rest (the swapped blocks' adapters too) moved, hooked
        sys.path.insert(0, str(ROOT / "src"))
        from diffrelay.runtime import block_swap

        swapper = block_swap.BlockSwap(block_swap.swap_blocks(
            model, ("transformer_blocks", "single_transformer_blocks"), swap), device)
        model.to(device)
        swapper.hook()
        out["host_gib"] = gib(swapper.frozen_bytes())
    model.enable_gradient_checkpointing()
    model.train()
    opt = make_optimizer(name, trainable, fused)
    data = batch(config, shape, device)
    target = data.pop("target")
    sync(device)
    out["setup_s"] = round(time.perf_counter() - t0, 2)
    if cuda:
        out["weights_gib"] = gib(torch.cuda.memory_allocated(device))
        out["setup_peak_gib"] = gib(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(steps):
        if i >= 2 and time.time() > deadline:  # a warm-up and one timed step at least
            out["stopped_by_budget_after"] = i
            break
        sync(device)
        s = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(**data, return_dict=False)[0]
        loss = (pred.float() - target.float()).square().mean()
        loss.backward()
        if i == 0:  # gaussian init: lora_B starts at zero, so its gradient is the one that must flow
            out["adapter_grad_norm_first_step"] = float(opt.grad_norm()) if fused else float(torch.stack(
                [p.grad.float().norm() for p in trainable if p.grad is not None]).norm()) if trainable else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - s)
        losses.append(float(loss))
    out["step_seconds"] = [round(x, 4) for x in times]
    out["s_per_step"] = round(statistics.median(times[1:]), 4) if len(times) > 1 else None
    out["losses"] = [round(x, 5) for x in losses]
    out["finite"] = all(x == x and abs(x) != float("inf") for x in losses)
    if cuda:
        out["train_peak_gib"] = gib(torch.cuda.max_memory_allocated(device))
        out["peak_gib"] = max(out["setup_peak_gib"], out["train_peak_gib"])
        out["reserved_peak_gib"] = gib(torch.cuda.max_memory_reserved(device))
    else:
        import resource

        out["max_rss_gib"] = gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def against_unswapped(case: str, res: dict, done: dict) -> dict:
    """A /swapN case beside the same case without it, run before: the peak it saved, the time it cost, and
    whether the losses are the same numbers."""
    plain = done.get("/".join(p for p in case.split("/") if not p.startswith("swap")))
    if plain is None or not parse_case(case)[3] or not (res.get("ok") and plain.get("ok")):
        return {}
    out = {"same_losses_as_unswapped": res["losses"] == plain["losses"][:len(res["losses"])]}
    if res.get("peak_gib") is not None and plain.get("peak_gib") is not None:
        out["peak_gib_saved"] = round(plain["peak_gib"] - res["peak_gib"], 3)
    if res.get("s_per_step") and plain.get("s_per_step"):
        out["s_per_step_cost"] = round(res["s_per_step"] - plain["s_per_step"], 4)
    return out


def child(args) -> int:
    """--case: one case in this process, its result (or its failure) to --result."""
    device = torch.device("cpu" if args.cpu_check else "cuda")
    config, shape = (TINY, SHAPES["tiny"]) if args.cpu_check else (FLUX_DEV, SHAPES["full"])
    try:
        res = {"ok": True, **run_case(args.case, config, shape, device, args.steps, args.deadline)}
    except BaseException as e:  # noqa: BLE001 - recorded, the parent goes on with the next case
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        if device.type == "cuda":
            res["peak_gib_at_failure"] = gib(torch.cuda.max_memory_allocated(device))
    Path(args.result).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


# ---------------------------------------------------------------- the parent: environment, cases, JSON

def use_bundle(bundle: Path | None, tmp: Path, env: dict) -> dict:
    """Unpack tools/gpu_bundle.py --with-lora's tar.xz (or take its folder) and put it on the children's path."""
    info = {"bundle": str(bundle) if bundle else None}
    if bundle is None:
        return info
    if bundle.is_dir():
        site = bundle / "site" if (bundle / "site").is_dir() else bundle
    else:
        t0 = time.time()
        with tarfile.open(bundle) as tar:
            tar.extractall(tmp / "bundle", filter="data")
        site, info["unpack_seconds"] = tmp / "bundle" / "site", round(time.time() - t0, 1)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return info


VERSIONS = """
import importlib, json, sys
out = {}
for name in ("torch", "diffusers", "peft", "transformers", "torchao", "accelerate", "huggingface_hub", "tokenizers"):
    try:
        m = importlib.import_module(name)
        out[name] = {"version": getattr(m, "__version__", None), "path": getattr(m, "__file__", None)}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
print(json.dumps(out))
"""


def environment(env: dict, cpu: bool) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if not cpu:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = gib(torch.cuda.get_device_properties(0).total_memory)
    p = subprocess.run([sys.executable, "-c", VERSIONS], capture_output=True, text=True, env=env, timeout=300)
    try:
        info["packages"] = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        info["packages"] = {"error": p.stderr[-2000:]}
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON (default benchmarks/results/gpu_flux_lora.json;"
                    " on a lent machine give $OUT/gpu_flux_lora.json)")
    ap.add_argument("--bundle", help="tools/gpu_bundle.py --with-lora's tar.xz or folder (default "
                    "build/gpu-bundle-lora.tar.xz where it exists, not with --cpu-check; 'none': the interpreter's "
                    "own packages)")
    ap.add_argument("--cases", default="int8,none", help="comma-separated, in order, each "
                    "QUANT[/OPTIMIZER][/fused][/swapN]: int8 (first: the figure issue 56 compares with SimpleTuner's) "
                    "or none; a train.optimizer (default adamw); fused = train.fused_backward; swapN = train.block_swap"
                    " N. E.g. int8,none,int8/ao_adamw8bit,int8/prodigy,int8/adamw/fused,none/swap16,int8/swap16 "
                    "(issue 68)")
    ap.add_argument("--steps", type=int, default=6, help="steps a case: one warm-up, then the timed ones")
    ap.add_argument("--budget", type=float, default=300, help="seconds: no case starts past it, a running one is "
                    "stopped at it")
    ap.add_argument("--cpu-check", action="store_true", help="the same code path on the CPU, tiny config")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # a child: this one case
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return child(args)
    if not args.cpu_check and not torch.cuda.is_available():
        print("gpu_flux_lora: no CUDA device (--cpu-check runs it small on the CPU)", flush=True)
        return 2
    start = time.time()
    deadline = start + args.budget
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for case in cases:
        try:
            parse_case(case)
        except ValueError as e:
            ap.error(f"--cases: {e}")
    # The default bundle is the GPU machine's (cp312): --cpu-check takes it only when --bundle names it.
    bundle = None if args.bundle == "none" else Path(args.bundle) if args.bundle else \
        DEFAULT_BUNDLE if DEFAULT_BUNDLE.exists() and not args.cpu_check else None
    with tempfile.TemporaryDirectory() as tmp:
        report = {"benchmark": "gpu_flux_lora", "issue": 56, "cpu_check": args.cpu_check,
                  "model": "FluxTransformer2DModel, FLUX.1-dev's config, random weights" if not args.cpu_check else
                  "FluxTransformer2DModel, tiny config (--cpu-check)",
                  "config": {**(TINY if args.cpu_check else FLUX_DEV), "axes_dims_rope": list(
                      (TINY if args.cpu_check else FLUX_DEV)["axes_dims_rope"])},
                  "shape": SHAPES["tiny" if args.cpu_check else "full"], "batch": 1,
                  "lora": {"rank": RANK, "alpha": ALPHA, "init": "gaussian", "target_modules": TARGETS,
                           "via": "peft.inject_adapter_in_model"},
                  "precision": "bf16 base weights (int8 weight-only for int8), fp32 adapter and AdamW state, "
                               "bf16 autocast forward, fp32 loss",
                  "gradient_checkpointing": True, "optimizer": f"per case; adamw: torch's AdamW lr {LR}", "steps": args.steps,
                  "s_per_step": "median of the steps after the first (warm-up)",
                  "peak_gib": "torch.cuda.max_memory_allocated over the case's own process, setup included",
                  "reference": "SimpleTuner's FLUX quickstart: about 18 GB with int8",
                  "budget_s": args.budget}
        report["environment"] = {**use_bundle(bundle, Path(tmp), env)}
        report["environment"].update(environment(env, args.cpu_check))
        report["cases"] = {}

        def save():
            report["elapsed_s"] = round(time.time() - start, 1)
            out.write_text(json.dumps(report, indent=1) + "\n")

        save()
        for case in cases:
            left = deadline - time.time()
            if left <= 0:
                report["cases"][case] = {"ok": False, "skipped": f"--budget {args.budget:g} s spent"}
                save()
                print(f"gpu_flux_lora: {case}: skipped (--budget {args.budget:g} s spent)", flush=True)
                continue
            result = Path(tmp) / f"{case.replace('/', '+')}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--result", str(result),
                   "--steps", str(args.steps), "--deadline", str(deadline)]
            cmd += ["--cpu-check"] if args.cpu_check else []
            t0 = time.time()
            try:  # 30 s past the deadline: the child stops its own steps there and writes what it has
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=left + 30)
                res = json.loads(result.read_text()) if result.exists() else \
                    {"ok": False, "error": f"exit {p.returncode}, no result", "stderr": p.stderr[-3000:]}
                if p.returncode and "stderr" not in res:
                    res["stderr"] = p.stderr[-1500:]
            except subprocess.TimeoutExpired:
                res = {"ok": False, "error": f"stopped at --budget {args.budget:g} s"}
            res["wall_s"] = round(time.time() - t0, 1)
            res.update(against_unswapped(case, res, report["cases"]))
            report["cases"][case] = res
            save()
            keys = ("ok", "peak_gib", "s_per_step", "params", "trainable", "error", "max_rss_gib")
            print(f"gpu_flux_lora: {case}: " + json.dumps({k: res[k] for k in keys if k in res}), flush=True)
    print(f"gpu_flux_lora: wrote {out} ({report['elapsed_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
