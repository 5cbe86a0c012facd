"""specjax: speculative decoding for large-vocabulary LLMs in JAX.

Top-level API::

    specjax.convert(src, out)            # HF folder or GGUF -> specjax folder
    target = specjax.load(out)
    result = specjax.generate(target, "Hello", max_new_tokens=64)
    drafter = specjax.load_drafter(path, target)
    result = specjax.generate(target, "Hello", drafter=drafter, tree=specjax.TreeSpec())
    for chunk in specjax.stream(target, "Hello", drafter=drafter):
        print(chunk.text, end="", flush=True)
    target = specjax.load(out, mesh="data=2,model=4")  # SPMD: see docs/sharding.md
    result = specjax.generate(target, prompts, mesh="data=2,model=4")
"""

# The imports below come after this call (E402): it must run before any of them imports
# transformers.
# ruff: noqa: E402
from specjax.compat import keep_hub_kernels_importable

keep_hub_kernels_importable()

from specjax.api import Chunk, GenerationResult, generate, load, load_drafter, stream
from specjax.config import ModelConfig
from specjax.convert import convert
from specjax.loaded import Drafter, Target
from specjax.sampling import SamplingConfig
from specjax.sharding import init_distributed, make_mesh
from specjax.speculative import TreeSpec

__all__ = ["Chunk", "Drafter", "GenerationResult", "ModelConfig", "SamplingConfig", "Target",
           "TreeSpec", "convert", "generate", "init_distributed", "load", "load_drafter",
           "make_mesh", "stream"]
__version__ = "0.1.0"
