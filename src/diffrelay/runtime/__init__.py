"""Runtime: the process group and the launcher (`distributed`, the only module that knows ranks), GPU
slots on one machine (`gpus`), an ordered parallel map (`parallel`), the speed switches (`speed`),
which SLURM tool can watch the workflow's jobs (`slurm`), which work folder a live process holds (`claims`) and
whether a memory-mapped file still holds its array (`mapped`).

Imports only the base modules (errors, io, logs): everything else may import it.
"""
