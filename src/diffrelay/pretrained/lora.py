"""train.lora: a LoRA adapter (peft) on a model.pretrained run's network (docs/pretrained.md, "LoRA").

  config      check_config fills rank, alpha and target_modules and refuses what cannot work (torch-free);
              check_targets refuses a target module the network lacks (diffrelay validate, the Snakefile)
  training    attach adds the adapter (seeded: every segment draws the same init), freezes the base;
              only()/load() keep checkpoints and snapshots to the adapter's tensors
  export      export writes the adapter as diffusers' pytorch_lora_weights.safetensors (the weights the run scores,
              sample.weights; the others beside it, file_names; the raw ones alone where train.ema_decays: [] keeps
              no EMA), through the pipeline class's own save_lora_weights, so load_lora_weights reads it
  sampling    check_base refuses an adapter sampled on another base than the one it was trained on

The base weights are never stored: they come from the pipeline folder, whose sha256s are the run's identity.
"""

import json
import os
import warnings

from diffrelay import families
from diffrelay.errors import UserError
from diffrelay.families.base import ATTENTION_TARGETS

# train.lora.target_modules' default: the family's lora_targets (families/; the attention projections diffusers' LoRA
# training scripts adapt, families.base.ATTENTION_TARGETS, unless the family's script adapts more).
TARGETS = list(ATTENTION_TARGETS)
# train.lora.quantize_base: torchao's weight-only configs (int8 runs on the CPU too; fp8 is emulated there); nf4 is
# bitsandbytes' (its CPU backend too)
QUANTIZERS = {"int8": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig"}
# <run>/lora/step_N/: WEIGHT_NAME, what load_lora_weights(folder) reads, holds the weights the run samples and scores
# (sample.weights: the first EMA's, or the raw ones; raw where no EMA is kept); the others beside it under their kind's
# name (file_names)
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
RAW_NAME = "pytorch_lora_weights_raw.safetensors"  # the trained weights themselves, beside the EMA's
EMA_NAME = "pytorch_lora_weights_ema.safetensors"  # the first EMA's, beside the raw weights of sample.weights: raw
MARK = ".lora_"  # in every LoRA (and DoRA) tensor's state-dict key (lora_A, lora_B, lora_magnitude_vector)
# train.lora.kind's tensors: LoRA's and DoRA's, LoKr's (lokr_w1, lokr_w2, ...) and LoHa's (hada_w1_a, ...); in no base key
MARKS = (MARK, ".lokr_", ".hada_")
PEFT_NAME = "adapter_model.safetensors"  # LoKr and LoHa adapters as peft saves them, beside its adapter_config.json


def is_adapter(key: str) -> bool:
    return any(m in key for m in MARKS)


def check_config(d: dict) -> list[tuple[str, str]]:
    """Fill train.lora's defaults in place; (key, message) pairs of what cannot work."""
    t = d["train"]
    spec = t.get("lora")
    sampled = (d.get("sample") or {}).get("quantize_base")
    if spec is None:
        return [] if sampled is None else [
            (f"sample.quantize_base={sampled}", "quantizes a LoRA run's frozen base, and this run has no train.lora; "
             "set it to null")]
    if d["model"].get("pretrained") is None:
        return [("train.lora", "needs model.pretrained (the diffusers pipeline folder whose network the adapter "
                 "trains); set model.pretrained, or drop train.lora")]
    if spec["alpha"] is None:
        spec["alpha"] = spec["rank"]
    if spec["target_modules"] is None:
        family = families.of_config(d["model"])
        spec["target_modules"] = list(family.lora_targets if family else TARGETS)
    if t["phema"]["every"]:
        return [(f"train.phema.every={t['phema']['every']}", "post-hoc EMA is not kept for train.lora runs; "
                 "set train.phema.every: 0 (train.ema_decays averages the adapter)")]
    return quantize_problems(spec, t) + quantize_problems({"quantize_base": sampled}, {}, "sample.quantize_base")


def quantize_problems(spec: dict, train: dict, name: str = "train.lora.quantize_base") -> list[tuple[str, str]]:
    """train.lora.quantize_base (or sample.quantize_base, `name`) against what can run (torch-free: the config's
    checks)."""
    kind = spec.get("quantize_base")
    if kind is None:
        return []
    key = f"{name}={kind}"
    if train.get("sharding") == "fsdp2":
        return [(key, "a quantized frozen base is not sharded here (train.sharding: fsdp2); use train.sharding: "
                 "ddp (a LoRA run's state is its adapter) or quantize_base: null")]
    import importlib.util

    library = "bitsandbytes" if kind == "nf4" else "torchao"
    if importlib.util.find_spec(library) is None:
        return [(key, f"needs {library}, which is not installed; pip install 'diffrelay[quantize]' (or {library})")]
    return []


def quantize(net, kind: str | None, precision: str = "fp32") -> None:
    """Quantize the frozen base's nn.Linear weights of the diffusers network inside `net` in place, before the
    adapter is attached (peft then wraps each quantized layer; the adapter stays in full precision). int8, fp8:
    torchao's weight-only configs (its quantize_ picks the linear layers). nf4: bitsandbytes' Linear4bit with
    NF4 weights and double-quantized scales (QLoRA's, Dettmers et al. 2023: load_in_4bit, bnb_4bit_quant_type
    nf4, bnb_4bit_use_double_quant), computing in bf16 under train.precision bf16, else fp32; its Params4bit
    quantizes when moved to the layer's device. None: nothing."""
    if kind is None:
        return
    from diffrelay.pretrained import weights

    model = weights.text_net(net)
    if kind in QUANTIZERS:
        import torchao.quantization as tq

        tq.quantize_(model, getattr(tq, QUANTIZERS[kind])())
        return
    import bitsandbytes as bnb
    import torch

    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    linear = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, lin in linear:
        parent, _, leaf = name.rpartition(".")
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=compute,
                              compress_statistics=True, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                     quant_type="nf4")
        q.bias = lin.bias
        setattr(model.get_submodule(parent) if parent else model, leaf, q.to(lin.weight.device))


def enabled(cfg_dict: dict) -> dict | None:
    """train.lora of a config (a dict), None when off."""
    return ((cfg_dict or {}).get("train") or {}).get("lora")


def check_targets(net, targets) -> None:
    """peft only refuses when no target matches at all: each one must match some module (by name suffix) of the
    diffusers network inside `net` (built on any device, meta too)."""
    from diffrelay.pretrained import weights

    model = weights.text_net(net)
    names = [n for n, _ in model.named_modules() if n]
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            import torch

            def leaf(n):  # to_out.0, not 0
                return ".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]

            # Linear layers first: where LoRA usually goes.
            leaves = sorted({leaf(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            leaves += sorted({leaf(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)} - set(leaves))
            raise UserError(f"train.lora.target_modules: {target!r} matches no module of {type(model).__name__}; "
                            f"use module names it has, e.g. {', '.join(leaves[:8])}")


def attach(net, spec: dict, seed: int) -> list:
    """Add the adapter to the diffusers network inside `net` and freeze everything else; the trainable
    parameters. The adapter's init is drawn from `seed` (CPU generator, forked: the caller's draws go on)."""
    import torch

    from diffrelay.pretrained import weights

    check_targets(net, spec["target_modules"])
    model = weights.text_net(net)
    config = peft_config(spec)
    net.requires_grad_(False)
    # peft draws the init on the CPU; only the CPU generator is seeded (torch.manual_seed would reseed CUDA's too).
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft warns that an adapter on a torchao base (quantize_base int8, fp8) cannot merge() or unmerge(): none is
        # ever merged here (export fuses the adapter into the pipeline's own, unquantized, weights: load_snapshot's
        # quantize (None,)), and training and sampling run it unmerged. Nothing a user could act on.
        warnings.filterwarnings("ignore", message=r"TorchaoLoraLinear was instantiated without "
                                r"`get_apply_tensor_subclass`", category=UserWarning)
        torch.random.default_generator.manual_seed(seed)
        if hasattr(type(model), "add_adapter"):  # diffusers' PeftAdapterMixin (UNet, SD3)
            model.add_adapter(config)
        else:  # PixArt's and HunyuanDiT's transformers lack the mixin: what add_adapter does, by peft itself
            from peft import inject_adapter_in_model

            inject_adapter_in_model(config, model)
            model.peft_config = {"default": config}
    trainable = []
    for name, p in net.named_parameters():
        p.requires_grad_(is_adapter(name))
        if is_adapter(name):
            trainable.append(p)
    return trainable


def peft_config(spec: dict):
    """peft's config of train.lora: LoraConfig as diffusers' LoRA scripts make it (gaussian init), with use_dora
    for dora (DoRA, Liu et al. 2024: the update split into magnitude and direction); LoKrConfig and LoHaConfig for
    lokr and loha (LyCORIS' Kronecker and Hadamard products), at peft's own init (the update starts at zero).
    rank and alpha are r and alpha in each."""
    import peft

    kind, common = spec.get("kind", "lora"), {"r": spec["rank"], "target_modules": list(spec["target_modules"])}
    if kind in ("lora", "dora"):
        return peft.LoraConfig(lora_alpha=spec["alpha"], lora_dropout=spec["dropout"], init_lora_weights="gaussian",
                               use_dora=kind == "dora", **common)
    cls = peft.LoKrConfig if kind == "lokr" else peft.LoHaConfig
    return cls(alpha=spec["alpha"], rank_dropout=spec["dropout"], **common)


def fuse(model) -> None:
    """Merge the adapter into the base weights and drop its layers, leaving diffusers' plain keys: diffusers'
    fuse_lora and unload_lora, or for a model without them (PixArt's, HunyuanDiT's) peft's merge of each layer."""
    if hasattr(type(model), "fuse_lora"):  # diffusers' PeftAdapterMixin (UNet, SD3)
        model.fuse_lora(lora_scale=1.0)
        model.unload_lora()
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, module.get_base_layer())
    del model.peft_config


def only(state: dict) -> dict:
    """The adapter's entries of a state dict."""
    return {k: v for k, v in state.items() if is_adapter(k)}


SHAPED_BY = ("kind", "rank", "target_modules")  # what decides an adapter's tensors (alpha only scales them)


def spec_difference(was: dict | None, now: dict) -> str | None:
    """Why a checkpoint whose config's train.lora is `was` does not hold this run's adapter (`now`), naming the first
    key of SHAPED_BY that differs and both values (kind absent: lora, the default); None when they match."""
    if was is None:
        return ("was made without train.lora (it trained every weight), and this run trains an adapter; start from a "
                "checkpoint of a train.lora run, or drop train.lora")
    for key in SHAPED_BY:
        a, b = was.get(key), now.get(key)
        if key == "kind":
            a, b = a or "lora", b or "lora"  # (records from before train.lora.kind: LoRA)
        elif key == "target_modules":
            a, b = sorted(a or []), sorted(b or [])  # peft matches each by name: the order is no part of it
        if a != b:
            return (f"holds an adapter of train.lora.{key}={json.dumps(a)}, and this run has train.lora.{key}="
                    f"{json.dumps(b)}; set train.lora.{key}: {json.dumps(a)} to start from it, or start from a "
                    f"checkpoint of a {key}={json.dumps(b)} adapter")
    return None


def load(module, state: dict, path) -> None:
    """Load adapter tensors over a network whose base is in place; every adapter tensor, nothing else."""
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a size mismatch: another rank (or DoRA/LoKr shapes) under the same names
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
        raise UserError(f"{path}: not this train.lora run's adapter ({first[:300]}): its rank is another; resume or "
                        "sample it with its own config (train.lora.rank)") from e
    gaps = [k for k in missing if is_adapter(k)]
    if unexpected or gaps:
        key = (unexpected or gaps)[0]
        raise UserError(f"{path}: {'holds' if unexpected else 'lacks'} {key}, so it is not this train.lora run's "
                        "adapter (its kind, rank and target_modules must be this run's); resume or sample it with its own config")


def export(folder, nets: dict, pipeline_cls: str, net_part: str, states: dict | None = None) -> bool:
    """Write the adapter of each network of `nets` ({file name: an objective's wrapper}) into <folder>/, keys
    and metadata as diffusers' LoRA scripts save them; atomic. False where the pipeline class has no LoRA loader
    (PixArt, HunyuanDiT): diffrelay's snapshot is then the only copy. `states` ({file name: the wrapper's adapter
    tensors, whole}): what to write where the wrappers hold shards (train.sharding: fsdp2)."""
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    from diffrelay import io
    from diffrelay.pretrained import weights

    cls = getattr(diffusers, pipeline_cls, None)
    config = weights.text_net(next(iter(nets.values()))).peft_config["default"]
    lycoris = type(config).__name__ in ("LoKrConfig", "LoHaConfig")  # no diffusers loader: peft's own files
    if not lycoris and not hasattr(cls, "save_lora_weights"):
        return False
    files = {name: peft_name(name) if lycoris else name for name in nets}
    ours = {n for name in (WEIGHT_NAME, RAW_NAME, EMA_NAME) for n in (name, peft_name(name))} | {"adapter_config.json"}
    with io.atomic_dir(folder, owned=lambda p: set(os.listdir(p)) <= ours) as tmp:  # any sample.weights' files
        for name, net in nets.items():
            model = weights.text_net(net)
            whole = None
            if states is not None:  # the wrapper's keys, less the path to the diffusers network inside it
                prefix = next(n for n, m in net.named_modules() if m is model)
                whole = {k[len(prefix) + 1:] if prefix else k: v for k, v in states[name].items()}
            layers = get_peft_model_state_dict(model, state_dict=whole)
            if lycoris:  # as PeftModel.save_pretrained writes them: the tensors and the config beside them
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in layers.items()}, str(tmp / files[name]),
                          metadata={"format": "pt"})
                io.write_json(tmp / "adapter_config.json", json.loads(json.dumps(config.to_dict(), default=sorted)))
                continue
            if net_part == "unet":  # train_text_to_image_lora(_sdxl).py's keys; the transformer scripts (SD3,
                # FLUX.1) save peft's as they are: converted, their to_q/k/v/out keys would become lora.down/up,
                # which the transformers' loaders skip
                layers = convert_state_dict_to_diffusers(layers)
            cls.save_lora_weights(tmp, **{f"{net_part}_lora_layers": layers,
                                          f"{net_part}_lora_adapter_metadata": model.peft_config["default"].to_dict()},
                                  weight_name=name, safe_serialization=True)
    return True


def file_names(scored: str, has_ema: bool) -> dict:
    """{"ema" | "raw": file name} of <run>/lora/step_N/: the weights the run samples and scores (sample.weights,
    `scored`) under WEIGHT_NAME, which load_lora_weights(folder) reads; the other under its own name."""
    if not has_ema:
        return {"raw": WEIGHT_NAME}
    return {"ema": WEIGHT_NAME, "raw": RAW_NAME} if scored == "ema" else {"raw": WEIGHT_NAME, "ema": EMA_NAME}


def peft_name(name: str) -> str:
    """The peft file of a LoKr or LoHa adapter for diffusers' file name: adapter_model(_raw).safetensors."""
    return name.replace(WEIGHT_NAME.split(".")[0], PEFT_NAME.split(".")[0])


def check_base(path, meta: dict, model_cfg: dict | None) -> dict:
    """The model.pretrained to sample a LoRA snapshot with: the config's (else the recorded one), whose files
    must be the base the adapter was trained on (the snapshot's recorded sha256s)."""
    from diffrelay.pretrained import folder

    recorded = (meta.get("model") or {}).get("pretrained") or {}
    spec = (model_cfg or {}).get("pretrained") or recorded
    try:
        sums = folder.manifest(folder.read(spec))
    except UserError as e:
        raise UserError(f"{path}: its LoRA adapter needs the base pipeline: {e}") from e
    want = recorded.get("sha256") or {}
    if sums != want:
        name = next(k for k in sorted(set(sums) | set(want)) if sums.get(k) != want.get(k))
        raise UserError(f"{path}: a LoRA adapter trained on another base pipeline ({name}: sha256 "
                        f"{str(want.get(name))[:12]}... when trained, {str(sums.get(name))[:12]}... in "
                        f"{spec['path'] if isinstance(spec, dict) else spec}); sample it with "
                        "the pipeline folder it was trained on")
    return spec
