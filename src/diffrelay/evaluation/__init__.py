"""Evaluation: what an evaluation consists of (`protocol`), feature extractors (`extractor`, `dinov2`),
image decoding and views (`features`), FID/KID and reference statistics (`fid`, the `fid` and `fid-ref`
stages), precision/recall and metric names (`metrics`), the run's report (`report`), metrics.csv's score columns as the
report and the trackers read them (`columns`) and the singular-reference warning (`refsize`).

Imports the base modules, runtime, data and text. Never training or sampling: it scores image folders and
reads their manifests, so a score does not depend on how the images were made.
"""
