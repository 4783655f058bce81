"""Runtime: the process group and the launcher (`distributed`, the only module that knows ranks), GPU
slots on one machine (`gpus`), an ordered parallel map (`parallel`) and the speed switches (`speed`).

Imports only the base modules (errors, io, logs): everything else may import it.
"""
