"""diffrelay: diffusion training in resumable torchrun segments, evaluated outside the process group."""

__version__ = "0.1.0"
