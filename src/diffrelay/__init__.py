"""diffrelay: diffusion training in resumable torchrun segments, evaluated outside the process group."""

__version__ = "0.1.0"

import logging as _logging

# torchao 0.18 (train.lora.quantize_base; peft imports it whenever it is installed) registers enums with torch's
# pytree, which torch 2.14 deprecates with one WARNING line per enum at import: noise on every LoRA command's
# stderr, where diffrelay keeps one line per problem. Only that logger is quietened.
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
# bitsandbytes 0.50 (quantize_base: nf4; peft imports it too) warns at import on a CPU with AVX512-BF16 that it could
# not fetch an optional kernel from the Hub (its `kernels` package, which would download): diffrelay downloads
# nothing, and bitsandbytes computes with its own CPU code instead.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# diffusers 0.42's torchao quantizer, imported whenever torchao is installed, looks for classes torchao 0.18 no longer
# has (they only matter for loading torchao-serialized checkpoints, which diffrelay never does) and warns on every
# load of a diffusers model.
_logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").setLevel(_logging.ERROR)
