"""The rules of text runs that span several keys (config.rules calls check_config; torch-free), and the text keys' part
in a run's identity (config.identity calls trajectory).

A text run is one with data.captions other than none. What belongs to text runs only (text encoders, caption
dropout, a held-out split, prompt files, CLIP score) is refused elsewhere, one line each, as are a text network
without captions and the reverse (nets.text_problems) and caption settings that contradict (captions.config_problems).
"""


# data keys of captioned datasets and their text encoders (docs/text.md): runs without captions drop them from
# their trajectory, so their hashes are the ones they had before text existed (config.identity.trajectory_of).
TEXT_KEYS = ("captions", "caption_column", "file_column", "caption_dropout", "val_fraction", "val_path",
             "text_encoders", "text_cache", "text_dtype")


def trajectory(data: dict) -> None:
    """The `data` section of a run's trajectory (config.identity.trajectory_of), in place: runs without captions read as
    they did before text existed; a cache or not (text_cache) changes no weight, and where the encoders are is no
    part of the run (their sha256 is, through the dataset's fingerprint)."""
    for key in TEXT_KEYS if data.get("captions", "none") == "none" else ("text_cache",):
        data.pop(key, None)
    if "text_encoders" in data:
        data["text_encoders"] = [{k: v for k, v in e.items() if k != "path"} for e in data["text_encoders"]]


def is_text(d: dict) -> bool:
    return d["data"].get("captions", "none") != "none"


def check_config(d: dict) -> list[tuple[str, str]]:
    from diffrelay import nets
    from diffrelay.data import captions

    data, s, fid = d["data"], d["sample"], d["fid"]
    bad = captions.config_problems(data) + nets.text_problems(d["model"], is_text(d))
    text = is_text(d)
    if text and not data["text_encoders"]:
        bad.append(("data.text_encoders", "a captioned run needs its text encoders: list local folders written by "
                    "transformers' save_pretrained (CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel)"))
    if text and d["model"]["class_conditional"]:
        bad.append(("model.class_conditional=true", "text runs condition on captions; set it to false"))
    prompts = s["prompts"]
    if prompts is not None and not text:
        bad.append(("sample.prompts", "prompts are for text runs (data.captions); drop it, or caption the dataset"))
    for f in [prompts] if isinstance(prompts, str) else prompts or []:
        from diffrelay.data.prompts import file_problem  # plain Python: a FIFO is not "no such file"

        if file_problem(f):
            bad.append((f"sample.prompts={f}", f"{file_problem(f)}; give a prompt file (one prompt a line, or "
                        "YAML/JSONL)"))
    scales = s["guidance"] if isinstance(s["guidance"], list) else [s["guidance"]]
    if text and s.get("guide") is None and all(g == 1 for g in scales) and s.get("true_cfg_scale", 1) == 1:
        from diffrelay.data import prompts as prompt_files  # reads the files: data's concern

        bad += prompt_files.unguided_negatives(prompts)
    if text and d["fid"]["final"]["best"]:
        bad.append(("fid.final.best", "a text run samples its prompt file (or held-out captions) in every pass, so a "
                    "second pass would score the same images again; set it to 0"))
    if text and prompts is None and not (data["val_fraction"] or data["val_path"]):
        bad.append(("sample.prompts", "a text run samples prompts: give a prompt file, or hold images out "
                    "(data.val_fraction or data.val_path) to sample their captions"))
    if s.get("held_out_captions") and not (text and prompts is not None and (data["val_fraction"] or data["val_path"])):
        bad.append(("sample.held_out_captions=true", "samples a text run's held-out captions beside its prompt files: "
                    "it needs data.captions, sample.prompts and a held-out split (data.val_fraction or data.val_path); "
                    "without a prompt file the held-out captions are what is sampled already"))
    if text and s["class_labels"] != "balanced":
        bad.append((f"sample.class_labels={s['class_labels']}", "a text run samples prompts, not classes; drop it"))
    wants_clip = "clip_score" in (fid["metrics"] or []) or fid["best_by"] == "clip_score"
    if wants_clip and not fid["clip_model"]:
        bad.append(("fid.clip_model", "clip_score needs a CLIP model: a local folder written by transformers' "
                    "save_pretrained (e.g. a copy of openai/clip-vit-large-patch14)"))
    if (wants_clip or fid["clip_model"]) and not text:
        bad.append(("fid.clip_model", "CLIP score compares images with their prompts: a text run's (data.captions)"))
    if fid.get("pick_model") and not text:
        bad.append(("fid.pick_model", "PickScore compares images with their prompts: a text run's (data.captions); "
                    "unset it"))
    if fid.get("classifier") and not text and not d["model"].get("class_conditional"):
        bad.append(("fid.classifier", "class_accuracy compares each image with the class or prompt it was sampled "
                    "for: a class-conditional run's (model.class_conditional) or a text run's; unset it"))
    return bad
