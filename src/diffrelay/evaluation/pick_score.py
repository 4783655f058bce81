"""PickScore: how much people would prefer each image for the prompt it was sampled from, by a local PickScore
model (fid.pick_model).

Formula (Kirstain et al. 2023, "Pick-a-Pic"; the PickScore README's calc_probs,
github.com/yuvalkirstain/PickScore): per image, logit_scale.exp() * cos(E_image, E_text), E being the CLIP's
projected embeddings and logit_scale the model's learned temperature (100 for PickScore_v1, so a score lies in
[-100, 100], about 20 for a good image); no clamp. The score is the mean over the images. calc_probs goes on to a
softmax over the images of one prompt, which ranks them against each other; a per-image score needs the logits.
benchmarks/checks/check_pick_score.py compares this with calc_probs itself.

The model is a CLIPModel (e.g. a local copy of yuvalkirstain/PickScore_v1 saved with the processor of
laion/CLIP-ViT-H-14-laion2B-s32B-b79K, which PickScore was trained with): loaded, checked and preprocessed exactly
as the CLIP score's (evaluation/clip_score.py: safetensors only, local only, sha256 recorded, PIL preprocessing,
prompts truncated to the text model's positions).
"""

from diffrelay.evaluation import clip_score

KEY = "fid.pick_model"


def check(folder, images=None) -> tuple[dict, str]:
    """The cheap checks of clip_score.check, naming fid.pick_model."""
    return clip_score.check(folder, images, KEY)


def load(folder, device="cpu") -> clip_score.Clip:
    return clip_score.load(folder, device, KEY)


def score(clip: clip_score.Clip, images, prompts, batch_size: int = 32) -> dict:
    """PickScore of `images` against `prompts` (one each): {"pick_score", "count", "per_image", "logit_scale",
    "model", "sha256", "truncated"}."""
    import numpy as np

    cos, truncated = clip_score.cosines(clip, images, prompts, batch_size, "PickScore")
    scale = float(clip.model.logit_scale.detach().double().exp())  # the README: model.logit_scale.exp()
    per_image = (scale * cos).tolist()
    return {"pick_score": float(np.mean(per_image)), "count": len(per_image), "per_image": per_image,
            "logit_scale": scale, "model": clip.folder, "sha256": clip.sha256, "truncated": truncated}


def score_folder(folder, clip: clip_score.Clip, batch_size: int = 32) -> dict:
    """PickScore of a sample folder: each NNNNNN.png against its NNNNNN.txt (clip_score.score_folder's rules)."""
    return clip_score.score_folder(folder, clip, batch_size, score)
