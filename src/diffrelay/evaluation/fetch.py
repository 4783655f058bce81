"""`diffrelay fetch-extractor`: download or build one feature extractor file (Inception, DINOv2, the
seeded random CNN) or check and copy a user's TorchScript file.

Example:
  diffrelay fetch-extractor --extractor inception --out resources/extractors/inception-2015-12-05.pt
"""

from pathlib import Path

from diffrelay import io, logs
from diffrelay.errors import UserError
from diffrelay.evaluation import dinov2, extractor


def main(args) -> int:
    logs.setup()
    weights = getattr(args, "weights", None)
    if weights and not args.extractor.startswith("dinov2"):
        raise UserError(f"--weights={weights}: only for --extractor dinov2[-MODEL]; drop it or change --extractor")
    if args.extractor == "inception":
        out = extractor.fetch_inception(args.out)
    elif args.extractor == "random":
        out = extractor.build_random(args.out, args.seed)
    elif args.extractor == "dinov2" or args.extractor.startswith("dinov2-"):
        out = dinov2.fetch(dinov2.parse(args.extractor), args.out, weights)
    elif Path(args.extractor).is_file():
        out = extractor.copy_custom(args.extractor, args.out)
    else:
        raise UserError(f"--extractor={args.extractor}: not 'inception', 'random', 'dinov2[-MODEL]' "
                        "or an existing TorchScript file")
    print(f"{out}\t{io.sha256_file(out)}")
    return 0
