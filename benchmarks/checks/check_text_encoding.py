"""diffrelay's text encoding (diffrelay.text.encoders.encode) against diffusers' own pipelines' encode_prompt, on the
same tiny random encoders and prompts.

  git clone https://github.com/huggingface/diffusers /tmp/diffusers
  python benchmarks/checks/check_text_encoding.py --diffusers-src /tmp/diffusers [--extra-path DIR]

--diffusers-src is a checkout of diffusers: its src/ goes first on sys.path, and the script refuses to run when the
diffusers it imports is another one (the one installed in the environment). --extra-path adds folders after it:
that diffusers imports httpx, which the environment may lack (pip install --target DIR httpx). Their code is
imported at run time; nothing of it enters the package.

Encoders, seeded and random, built here with the tests' builders (tests/textmodels.py: the shapes captions'
vocabulary) and saved with save_pretrained into a temporary folder; diffrelay reads them with encoders.load, the
pipelines get them from transformers' from_pretrained of the same folders (as a pipeline's from_pretrained loads
its text_encoder*/ and tokenizer*/ folders):
  clip     CLIPTextModel, 32 wide                      SD 1.x's, SDXL's first
  clip_l   CLIPTextModelWithProjection, 32 wide         SD3's first
  clip_g   CLIPTextModelWithProjection, 48 wide         SDXL's second, SD3's second
  t5       T5EncoderModel, 96 wide; a case-sensitive tokenizer, as T5's sentencepiece is
Pipelines: each built by its own __init__ with only its text parts, every other component None (vae, unet or
transformer, scheduler; SD's safety_checker and feature_extractor, requires_safety_checker=False; SDXL's
add_watermarker=False), then pipe.encode_prompt(..., device="cpu", num_images_per_prompt=1,
do_classifier_free_guidance=True) with negative_prompt None, so the unconditional embedding is the pipeline's own.
  sd1     StableDiffusionPipeline: prompt_embeds vs diffrelay [clip layer last]
  sdxl    StableDiffusionXLPipeline: prompt_embeds, pooled_prompt_embeds vs [clip penultimate, clip_g penultimate
          pooled]; negatives with force_zeros_for_empty_prompt false (the pipeline encodes "", as diffrelay's
          unconditional embedding, the empty caption's). Its default, true (SDXL base's model_index.json), gives
          zeros instead: written to the JSON, not gated
  sd3     StableDiffusion3Pipeline (max_sequence_length 256): prompt_embeds, pooled_prompt_embeds vs [clip_l, clip_g
          penultimate pooled, t5 use_mask false]; diffrelay's mask all ones (the pipeline has none: SD3's
          transformer takes none)
  pixart  PixArtSigmaPipeline (max_sequence_length 300, clean_caption=False): prompt_embeds, prompt_attention_mask
          vs [t5 max_length 300, use_mask true]. The pipeline lower-cases and strips every prompt
          (_text_preprocessing, also with clean_caption False); diffrelay's encoders take the text as given and
          its sampling applies the pipeline's rule (pretrained.PromptRules), so ours is given the prompts through
          that rule here, and the difference on the prompts as given is written to the JSON, not gated
Prompts (PROMPTS): 21, so diffrelay's fixed calls of 16 are crossed; among them the empty prompt, one of 320 words
(cut at 77 CLIP tokens, at 256 and 300 T5 tokens), mixed case, spaces around, a word outside the vocabulary.
Bound (BOUND, every embedding): max |ours - theirs| <= 1e-6, float32 on the CPU, both sides the same transformers
calls: only the batch differs (diffrelay's 16 rows, the pipeline's 21). Masks and shapes: equal. Sanity bounds:
the mask choice and the layer choice each change the embeddings by at least 1e-3, so a wrong one fails the gate.
Exit status 1, one line per figure outside its bound. Writes benchmarks/results/text_encoding_check.json.
Not a test: CI has no diffusers checkout.
"""

import argparse
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from official import RESULTS, ROOT, Gate, write_results

BOUND = 1e-6
SANITY = 1e-3
LONG = " ".join(["a photo of a red circle top left"] * 40)  # 320 words
PROMPTS = ["a red circle top left", "a blue square", "", "a photo of a green triangle bottom right", LONG,
           "A Red Circle Top Left", "  a photo of a PINK square center  ", "a zebra", "yellow", "photo of photo of",
           *[f"a {c} {s} {p}" for c, s, p in zip(("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink",
                                                  "red", "blue", "green"),
                                                 ("circle", "square", "triangle") * 4,
                                                 ("top", "bottom", "left", "right", "center") * 3)]]
T5_SD3, T5_PIXART = 256, 300


def import_diffusers(src: Path, extra: list[Path]):
    """diffusers from the checkout `src`, never the installed one."""
    sys.path[:0] = [str(src / "src")]
    sys.path.extend(str(p) for p in extra)
    try:
        import diffusers
        from diffusers import (PixArtSigmaPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline,
                               StableDiffusionXLPipeline)
    except (ModuleNotFoundError, RuntimeError) as e:
        why = " ".join(str(e).split())
        raise SystemExit(f"check_text_encoding: importing diffusers from {src}/src failed ({why}); a module it needs "
                         "is missing (httpx: pip install --target DIR httpx, then --extra-path DIR)") from e
    where = Path(diffusers.__file__).resolve()
    if not where.is_relative_to((src / "src").resolve()):
        raise SystemExit(f"check_text_encoding: imported diffusers from {where}, not from {src}/src (the installed "
                         "one?): give --diffusers-src a diffusers checkout, with its src/ folder")
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    print(f"diffusers {diffusers.__version__} from {where.parent} (commit {commit or 'unknown: not a git checkout'})")
    pipes = {"sd1": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline, "sd3": StableDiffusion3Pipeline,
             "pixart": PixArtSigmaPipeline}
    return diffusers, commit, pipes


def build_encoders(root: Path) -> dict:
    """The four encoder folders (tests/textmodels.py's builders); the T5's tokenizer made case-sensitive."""
    sys.path.insert(0, str(ROOT / "tests"))
    import textmodels as tm
    from tokenizers import normalizers

    folders = {"clip": tm.clip_text(root / "clip", seed=0),
               "clip_l": tm.clip_text(root / "clip_l", projection=True, hidden=32, seed=1),
               "clip_g": tm.clip_text(root / "clip_g", projection=True, hidden=48, seed=2),
               "t5": tm.t5(root / "t5", d_model=96, seed=3)}
    tokenizer = tm.t5_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([])  # T5's sentencepiece keeps the case
    tokenizer.save_pretrained(folders["t5"])
    return folders


def theirs_parts(folder: Path, cls: str):
    """(model, tokenizer) as a pipeline's from_pretrained loads them: transformers' classes, float32."""
    import transformers

    model = getattr(transformers, cls).from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                       dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def ours(folders: dict, spec: list, prompts: list):
    """diffrelay's Text of `prompts` with the encoders (name, entry settings) of `spec`."""
    from diffrelay.text import encoders

    encs = [encoders.load({"path": str(folders[name]), "max_length": None, "layer": "last", "pooled": False,
                           "use_mask": True} | kw, "cpu") for name, kw in spec]
    return encoders.encode(encs, prompts, "cpu")


def max_abs(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--diffusers-src", type=Path, required=True, help="a diffusers checkout (its src/ is imported)")
    ap.add_argument("--extra-path", type=Path, action="append", default=[],
                    help="another folder for sys.path, after the checkout (e.g. one holding httpx); may repeat")
    ap.add_argument("--out", type=Path, default=RESULTS / "text_encoding_check.json")
    args = ap.parse_args()
    diffusers, commit, pipes = import_diffusers(args.diffusers_src, args.extra_path)
    import transformers

    from diffrelay import logs

    # The long prompt is cut on purpose: the truncation warnings of both sides, and the progress bars, are noise.
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logs.get().setLevel(logging.ERROR)
    torch.set_grad_enabled(False)
    g, cases = Gate(), {}

    def gate(name: str, a, b, what: str) -> None:
        cases[name] = {"max_abs_diff": max_abs(a, b), "shape": list(b.shape), "what": what}
        g.at_most(name, cases[name]["max_abs_diff"], BOUND)

    with tempfile.TemporaryDirectory() as tmp:
        f = build_encoders(Path(tmp))
        clip, clip_tok = theirs_parts(f["clip"], "CLIPTextModel")
        clip_l, clip_l_tok = theirs_parts(f["clip_l"], "CLIPTextModelWithProjection")
        clip_g, clip_g_tok = theirs_parts(f["clip_g"], "CLIPTextModelWithProjection")
        t5, t5_tok = theirs_parts(f["t5"], "T5EncoderModel")
        empty = [""]

        # SD 1.x: one CLIPTextModel, its last hidden state (after the final layer norm).
        sd1 = pipes["sd1"](vae=None, text_encoder=clip, tokenizer=clip_tok, unet=None, scheduler=None,
                           safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        emb, neg = sd1.encode_prompt(PROMPTS, "cpu", 1, True)
        spec = [("clip", {})]
        mine, mine_empty = ours(f, spec, PROMPTS), ours(f, spec, empty)
        gate("sd1-prompt_embeds", mine.states, emb, "states of [clip last]")
        gate("sd1-negative_prompt_embeds", mine_empty.states.expand_as(neg), neg, "our empty caption's states")
        g.equal("sd1-mask-all-ones", bool((mine.mask == 1).all()), True)

        # SDXL: CLIP + CLIP with projection, penultimate layers side by side, the second's pooled embedding.
        parts = dict(vae=None, text_encoder=clip, text_encoder_2=clip_g, tokenizer=clip_tok, tokenizer_2=clip_g_tok,
                     unet=None, scheduler=None, add_watermarker=False)
        emb, neg, pooled, neg_pooled = pipes["sdxl"](**parts, force_zeros_for_empty_prompt=False).encode_prompt(
            PROMPTS, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True)
        spec = [("clip", {"layer": "penultimate"}), ("clip_g", {"layer": "penultimate", "pooled": True})]
        mine, mine_empty = ours(f, spec, PROMPTS), ours(f, spec, empty)
        gate("sdxl-prompt_embeds", mine.states, emb, "states of [clip penultimate, clip_g penultimate]")
        gate("sdxl-pooled_prompt_embeds", mine.pooled, pooled, "clip_g's text_embeds")
        gate("sdxl-negative_prompt_embeds", mine_empty.states.expand_as(neg), neg,
             "our empty caption's states (force_zeros_for_empty_prompt false)")
        gate("sdxl-negative_pooled_prompt_embeds", mine_empty.pooled.expand_as(neg_pooled), neg_pooled,
             "our empty caption's pooled (force_zeros_for_empty_prompt false)")
        _, zeros, _, zeros_pooled = pipes["sdxl"](**parts).encode_prompt(
            PROMPTS[:2], device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True)
        cases["sdxl-negative-default-not-gated"] = {
            "force_zeros_for_empty_prompt": True, "pipeline_negative_all_zero": bool(not zeros.any() and
                                                                                      not zeros_pooled.any()),
            "max_abs_of_our_empty_caption_states": float(mine_empty.states.abs().max()),
            "what": "SDXL's default unconditional embedding is zeros, diffrelay's the empty caption's (the one "
                    "caption dropout trained)"}
        last = ours(f, [("clip", {}), ("clip_g", {"pooled": True})], PROMPTS)
        cases["sanity-sdxl-last-vs-penultimate"] = {"max_abs_diff": max_abs(last.states, emb)}
        g.at_least("sanity-sdxl-last-vs-penultimate", cases["sanity-sdxl-last-vs-penultimate"]["max_abs_diff"],
                   SANITY)

        # SD3: two CLIPs with projection (penultimate, pooled) and a T5 called with no mask, along the tokens.
        sd3 = pipes["sd3"](transformer=None, scheduler=None, vae=None, text_encoder=clip_l, tokenizer=clip_l_tok,
                           text_encoder_2=clip_g, tokenizer_2=clip_g_tok, text_encoder_3=t5, tokenizer_3=t5_tok)
        emb, neg, pooled, neg_pooled = sd3.encode_prompt(PROMPTS, None, None, device="cpu", num_images_per_prompt=1,
                                                         do_classifier_free_guidance=True,
                                                         max_sequence_length=T5_SD3)
        spec = [("clip_l", {"layer": "penultimate", "pooled": True}),
                ("clip_g", {"layer": "penultimate", "pooled": True}), ("t5", {"use_mask": False})]
        mine, mine_empty = ours(f, spec, PROMPTS), ours(f, spec, empty)
        gate("sd3-prompt_embeds", mine.states, emb, "states of [clip_l, clip_g penultimate; t5 use_mask false]")
        gate("sd3-pooled_prompt_embeds", mine.pooled, pooled, "clip_l's and clip_g's text_embeds")
        gate("sd3-negative_prompt_embeds", mine_empty.states.expand_as(neg), neg, "our empty caption's states")
        gate("sd3-negative_pooled_prompt_embeds", mine_empty.pooled.expand_as(neg_pooled), neg_pooled,
             "our empty caption's pooled")
        g.equal("sd3-mask-all-ones", bool((mine.mask == 1).all()), True)
        masked = ours(f, spec[:2] + [("t5", {"use_mask": True})], PROMPTS)
        cases["sanity-sd3-with-t5-mask"] = {"max_abs_diff": max_abs(masked.states, emb)}
        g.at_least("sanity-sd3-with-t5-mask", cases["sanity-sd3-with-t5-mask"]["max_abs_diff"], SANITY)

        # PixArt-Sigma: the T5 with its mask, 300 tokens; the pipeline lower-cases and strips the prompt.
        pixart = pipes["pixart"](tokenizer=t5_tok, text_encoder=t5, vae=None, transformer=None, scheduler=None)
        emb, mask, neg, neg_mask = pixart.encode_prompt(PROMPTS, do_classifier_free_guidance=True, device="cpu",
                                                        clean_caption=False, max_sequence_length=T5_PIXART)
        spec = [("t5", {"max_length": T5_PIXART, "use_mask": True})]
        from diffrelay.pretrained import PromptRules

        prepared = [PromptRules(lower=True).text(p) for p in PROMPTS]  # what sampling a PixArt run gives them
        mine, mine_empty = ours(f, spec, prepared), ours(f, spec, empty)
        gate("pixart-prompt_embeds", mine.states, emb, "states of [t5 300, use_mask true], prompts lower().strip()")
        g.equal("pixart-prompt_attention_mask", torch.equal(mine.mask, mask.long()), True)
        cases["pixart-prompt_attention_mask"] = {"equal": torch.equal(mine.mask, mask.long()),
                                                 "tokens_per_prompt": mask.sum(1).tolist()}
        gate("pixart-negative_prompt_embeds", mine_empty.states.expand_as(neg), neg, "our empty caption's states")
        g.equal("pixart-negative_prompt_attention_mask", torch.equal(mine_empty.mask.expand_as(neg_mask),
                                                                     neg_mask.long()), True)
        as_given = ours(f, spec, PROMPTS)
        changed = [i for i, p in enumerate(PROMPTS) if p != prepared[i]]
        cases["pixart-prompts-as-given-not-gated"] = {
            "prompts_the_pipeline_changes": [PROMPTS[i] for i in changed],
            "max_abs_diff_on_those": max_abs(as_given.states[changed], emb[changed]),
            "max_abs_diff_on_the_others": max_abs(as_given.states[[i for i in range(len(PROMPTS)) if i not in
                                                                   changed]],
                                                  emb[[i for i in range(len(PROMPTS)) if i not in changed]]),
            "what": "PixArt's _text_preprocessing lower-cases and strips (clean_caption False too); diffrelay's "
                    "encoders take the text as given, and its sampling of a PixArt run does the same "
                    "(pretrained.PromptRules)"}
        unmasked = ours(f, [("t5", {"max_length": T5_PIXART, "use_mask": False})], prepared)
        cases["sanity-pixart-without-t5-mask"] = {"max_abs_diff": max_abs(unmasked.states, emb)}
        g.at_least("sanity-pixart-without-t5-mask", cases["sanity-pixart-without-t5-mask"]["max_abs_diff"], SANITY)

    for name, r in cases.items():
        if "max_abs_diff" in r:
            sanity = name.startswith("sanity")
            print(f"{name:38s} max |ours - diffusers| = {r['max_abs_diff']:.3g} ("
                  f"{'a wrong setting: at least' if sanity else 'at most'} {SANITY if sanity else BOUND:.0e})")
    p = cases["pixart-prompts-as-given-not-gated"]
    print(f"{'(not gated) pixart prompts as given':38s} {len(p['prompts_the_pipeline_changes'])} prompts the "
          f"pipeline lower-cases or strips differ by {p['max_abs_diff_on_those']:.3g}")
    print(f"{'(not gated) sdxl default negative':38s} zeros: "
          f"{cases['sdxl-negative-default-not-gated']['pipeline_negative_all_zero']}")
    write_results(args.out, "diffrelay text.encoders.encode vs diffusers' StableDiffusionPipeline, "
                  "StableDiffusionXLPipeline, StableDiffusion3Pipeline and PixArtSigmaPipeline encode_prompt, the "
                  "same tiny random encoders and prompts",
                  diffusers=diffusers.__version__, diffusers_commit=commit, transformers=transformers.__version__,
                  construction="each pipeline's own __init__ with its text encoders and tokenizers, every other "
                               "component None",
                  bound=BOUND, sanity_bound=SANITY, prompts=PROMPTS, cases=cases, gate=g.to_json())
    g.finish("check_text_encoding")


if __name__ == "__main__":
    main()
