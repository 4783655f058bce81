"""Data: the prepared dataset folder (`datasets`, built by the `prepare` stage), the resumable global
data order and per-step seeds (`order`), the per-position training draws (`augment`) and the batch
loader thread (`loader`).

Imports the base modules, runtime, nets, objectives (the loader draws the objective's noise) and text.
"""
