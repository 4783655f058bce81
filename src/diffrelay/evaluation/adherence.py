"""The per-file scores of a sample folder beside its FID: does each image show what it was asked for?
clip_score (fid.clip_model), pick_score (fid.pick_model) and class_accuracy (fid.classifier), each its own module;
here `diffrelay fid`'s three steps for all of them: the cheap checks in the parent (before the scoring child is
paid for), the flags the child gets, and the scores the child writes into the result (columns.PER_FILE).

Imports the base modules; each score's module when asked for.
"""

from diffrelay import logs

log = logs.get()
FLAGS = (("clip_model", "--clip-model"), ("pick_model", "--pick-model"), ("classifier", "--classifier"),
         ("prompts", "--prompts"))


def check(args) -> None:
    """Every asked-for model folder, and every image's prompt or intended label: one UserError line each."""
    if getattr(args, "clip_model", None):
        from diffrelay.evaluation import clip_score

        clip_score.check(args.clip_model, args.images)
    if getattr(args, "pick_model", None):
        from diffrelay.evaluation import pick_score

        pick_score.check(args.pick_model, args.images)
    if getattr(args, "classifier", None):  # every image's intended label too, before the costly FID pass
        from diffrelay.evaluation import class_accuracy

        class_accuracy.check(args.classifier, args.images, getattr(args, "prompts", None))


def flags(args) -> list:
    """The scoring child's flags of these scores."""
    return [a for key, flag in FLAGS if getattr(args, key, None) for a in (flag, getattr(args, key))]


def score(args, device, result: dict) -> None:
    """Each asked-for score of args.images, into `result` under its column's name (without the per-image list)."""
    if getattr(args, "clip_model", None):  # a text run: the CLIP score of the images and their prompts
        from diffrelay.evaluation import clip_score

        clip = clip_score.score_folder(args.images, clip_score.load(args.clip_model, device), args.batch_size)
        result["clip_score"] = {k: v for k, v in clip.items() if k != "per_image"}
        log.info(f"{args.images}: CLIP score {clip['clip_score']:.4f} ({clip['count']} images, {args.clip_model})")
    if getattr(args, "pick_model", None):  # PickScore of the same images and prompts (evaluation/pick_score.py)
        from diffrelay.evaluation import pick_score

        pick = pick_score.score_folder(args.images, pick_score.load(args.pick_model, device), args.batch_size)
        result["pick_score"] = {k: v for k, v in pick.items() if k != "per_image"}
        log.info(f"{args.images}: PickScore {pick['pick_score']:.4f} ({pick['count']} images, {args.pick_model})")
    if getattr(args, "classifier", None):  # class_accuracy (evaluation/class_accuracy.py)
        from diffrelay.evaluation import class_accuracy

        plan = class_accuracy.check(args.classifier, args.images, getattr(args, "prompts", None))
        acc = class_accuracy.score_folder(plan, class_accuracy.load(args.classifier, device), args.batch_size)
        result["class_accuracy"] = {k: v for k, v in acc.items() if k != "per_image"}
        log.info(f"{args.images}: class accuracy {acc['class_accuracy']:.4f} ({acc['correct']} of {acc['count']} "
                 f"images, {args.classifier})")
