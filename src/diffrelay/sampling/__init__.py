"""Sampling: images from a snapshot in a standalone process (`sample`, the `sample` stage), the sample
folder and its manifest (`folder`), classifier-free guidance (`guidance`) and diffusers' schedulers
(`schedulers`, sample.scheduler).

Imports the base modules, config, runtime, families, nets, objectives, text, data (the seed range) and training (to read
snapshots).
"""
