"""Training memory of the seed users' pipelines, full fine-tuning against LoRA, before any weight is downloaded
(issue 40, item 5): what `diffrelay validate` prints for such a run, computed here from each network's published
config alone.

  python benchmarks/pretrained_memory.py            # writes benchmarks/results/pretrained_memory.json

Each network is built as training builds it (objectives.build, the family's arch and text widths) on the meta
device (no memory, no weights), from the config.json of its diffusers folder on the Hub (CONFIGS, each with its
repository; the published parameter count beside it), and counted by nets.footprint: fp32 weights and gradients,
AdamW's two moments and one EMA copy (train.ema_decays: one decay), the training state diffrelay holds. The LoRA
rows attach train.lora's family defaults (rank 4, lora.FAMILY_TARGETS) with peft on the meta network: only the
adapter gets gradients, moments and an EMA (the frozen base is shared, training.optim.EMA). Activations are not in
these figures: `diffrelay validate` measures them per run (resolution, batch, precision, checkpointing). The full
rows also give a process's state under train.sharding: fsdp2 on 8 and 16 GPUs (config.memory.sharded_state: the
state divided by the processes, plus the gathered bf16 weights of the two largest blocks).
"""

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE / "checks"))  # official.py

GB = 1e9
# The network config.json of each diffusers folder (less _class_name/_diffusers_version and the keys diffrelay sets
# from the text encoders and latents: sample_size, in_channels and the text widths, given in TEXT), and the text
# encoders' dims. Parameter counts as published: SDXL's UNet 2.6 B (SDXL paper, Table 1: 2.6 B), SD3-medium's
# transformer 2 B (SD3 medium model card), HunyuanDiT 1.5 B (its model card), PixArt-Sigma 0.6 B (its paper), SD3.5
# Large 8.1 B and Medium 2.5 B (their model cards), FLUX.1-dev 12 B (its model card; schnell is the same network less
# the guidance embedder).
CONFIGS = {
    "sdxl-base-1.0": {
        "repo": "stabilityai/stable-diffusion-xl-base-1.0 unet/config.json", "arch": "diffusers-unet",
        "published": 2.6e9, "latent": (4, 128), "text": {"states": 2048, "length": 77, "pooled": 1280},
        "kwargs": {"block_out_channels": [320, 640, 1280], "layers_per_block": 2, "attention_head_dim": [5, 10, 20],
                   "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True,
                   "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                   "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                   "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
                   "projection_class_embeddings_input_dim": 2816, "out_channels": 4, "time_scale": 1}},
    "sd3-medium": {
        "repo": "stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json", "arch": "sd3",
        "published": 2.0e9, "latent": (16, 128), "text": {"states": 4096, "length": 333, "pooled": 2048},
        "kwargs": {"patch_size": 2, "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
                   "caption_projection_dim": 1536, "out_channels": 16, "pos_embed_max_size": 192,
                   "time_scale": 1000}},
    "sd3.5-large": {
        "repo": "stabilityai/stable-diffusion-3.5-large transformer/config.json", "arch": "sd3",
        "published": 8.1e9, "latent": (16, 128), "text": {"states": 4096, "length": 333, "pooled": 2048},
        "kwargs": {"patch_size": 2, "num_layers": 38, "attention_head_dim": 64, "num_attention_heads": 38,
                   "caption_projection_dim": 2432, "out_channels": 16, "pos_embed_max_size": 192,
                   "qk_norm": "rms_norm", "time_scale": 1000}},
    "sd3.5-medium": {
        "repo": "stabilityai/stable-diffusion-3.5-medium transformer/config.json", "arch": "sd3",
        "published": 2.5e9, "latent": (16, 128), "text": {"states": 4096, "length": 333, "pooled": 2048},
        "kwargs": {"patch_size": 2, "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
                   "caption_projection_dim": 1536, "out_channels": 16, "pos_embed_max_size": 384,
                   "qk_norm": "rms_norm", "dual_attention_layers": list(range(13)), "time_scale": 1000}},
    "flux.1-dev": {
        "repo": "black-forest-labs/FLUX.1-dev transformer/config.json", "arch": "flux",
        "published": 12e9, "latent": (16, 128), "text": {"states": 4096, "length": 512, "pooled": 768},
        "kwargs": {"patch_size": 1, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                   "num_attention_heads": 24, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
                   "time_scale": 1}},
    "hunyuandit-v1.1": {
        "repo": "Tencent-Hunyuan/HunyuanDiT-v1.1-Diffusers transformer/config.json", "arch": "hunyuandit",
        "published": 1.5e9, "latent": (4, 128), "text": {"states": 2048, "length": 77 + 256, "pooled": 0},
        "kwargs": {"num_attention_heads": 16, "attention_head_dim": 88, "hidden_size": 1408, "patch_size": 2,
                   "num_layers": 40, "mlp_ratio": 4.3637, "learn_sigma": True, "cross_attention_dim": 1024,
                   "norm_type": "layer_norm", "pooled_projection_dim": 1024, "text_len": 77, "text_len_t5": 256,
                   "activation_fn": "gelu-approximate", "time_scale": 1}},
    "pixart-sigma-xl-2-1024": {
        "repo": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS transformer/config.json", "arch": "pixart",
        "published": 0.6e9, "latent": (4, 128), "text": {"states": 4096, "length": 300, "pooled": 0},
        "kwargs": {"num_attention_heads": 16, "attention_head_dim": 72, "out_channels": 8, "num_layers": 28,
                   "patch_size": 2, "norm_type": "ada_norm_single", "norm_elementwise_affine": False,
                   "norm_eps": 1e-6, "cross_attention_dim": 1152, "use_additional_conditions": False,
                   "interpolation_scale": 2, "time_scale": 1}},
}


def model_section(spec: dict) -> dict:
    from diffrelay import config

    m = config.validate({})["model"]
    objective = "flow" if spec["arch"] in ("sd3", "flux") else "ddpm"
    return {**m, "arch": spec["arch"], "kwargs": dict(spec["kwargs"]), "objective": objective,
            "class_conditional": False}


def measure(name: str, spec: dict) -> dict:
    from diffrelay import objectives
    from diffrelay.config.memory import sharded_state
    from diffrelay.nets import footprint, registry
    from diffrelay.pretrained import lora

    channels, side = spec["latent"]
    out = {"config": spec["repo"], "published_params": spec["published"]}
    for kind in ("full", "lora"):
        with registry.on_device("meta"):
            net = objectives.build(model_section(spec), side, 0, channels, text=spec["text"])
            if kind == "lora":
                targets = lora.FAMILY_TARGETS.get(spec["arch"], lora.TARGETS)
                lora.attach(net, {"rank": 4, "alpha": 4, "dropout": 0.0, "target_modules": targets}, 0)
        n = footprint.counts(net)
        state = footprint.state_bytes(n["params"], n["trainable"], "adamw", 1, n["bytes_per_param"],
                                      n["buffer_bytes"])
        out[kind] = {"params": n["params"], "trainable": n["trainable"],
                     **{k: round(v / GB, 2) for k, v in state.items()},
                     "total_gb": round(sum(state.values()) / GB, 2)}
        if kind == "full":  # train.sharding: fsdp2 (config.memory.sharded_state): the state / N + two gathered blocks
            def build():
                with registry.on_device("meta"):
                    return objectives.build(model_section(spec), side, 0, channels, text=spec["text"])

            for gpus in (8, 16):
                share, gathered = sharded_state(state, gpus, build, "bf16")
                out[kind][f"fsdp2_{gpus}_gpus_total_gb"] = round(sum(share.values()) / GB, 2)
                out[kind][f"fsdp2_{gpus}_gpus_gathered_gb"] = round(gathered / GB, 2)
    return out


def main() -> None:
    t0 = time.perf_counter()
    results = {name: measure(name, spec) for name, spec in CONFIGS.items()}
    print(f"{'pipeline':24} {'params':>14} {'full: state GB':>15} {'fsdp2 x8':>9} {'fsdp2 x16':>10} "
          f"{'LoRA: trainable':>16} {'state GB':>9}")
    for name, r in results.items():
        f = r["full"]
        print(f"{name:24} {f['params']:>14,} {f['total_gb']:>15.1f} {f['fsdp2_8_gpus_total_gb']:>9.1f} "
              f"{f['fsdp2_16_gpus_total_gb']:>10.1f} {r['lora']['trainable']:>16,} {r['lora']['total_gb']:>9.1f}")
    out = HERE / "results" / "pretrained_memory.json"
    from official import write_results  # atomic, with torch, machine and date

    write_results(out, "training state (fp32 weights, gradients, AdamW moments, one EMA) of each pipeline's network, "
                  "full and LoRA rank 4, from its published config on the meta device; activations not included; "
                  "full under train.sharding fsdp2 on 8 and 16 GPUs: the state / N plus two blocks' gathered bf16 "
                  "weights, a process",
                  seconds=round(time.perf_counter() - t0, 1), results=results)


if __name__ == "__main__":
    main()
