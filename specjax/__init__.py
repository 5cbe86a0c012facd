"""specjax: speculative decoding for large-vocabulary LLMs in JAX.

Top-level API::

    specjax.convert(src, out)            # HF folder or GGUF -> specjax folder
    target = specjax.load(out)
    result = specjax.generate(target, "Hello", max_new_tokens=64)
    drafter = specjax.load_drafter(path, target)
    result = specjax.generate(target, "Hello", drafter=drafter, tree=specjax.TreeSpec())
    for chunk in specjax.stream(target, "Hello", drafter=drafter):
        print(chunk.text, end="", flush=True)
"""

from specjax.api import Chunk, GenerationResult, generate, load, load_drafter, stream
from specjax.config import ModelConfig
from specjax.convert import convert
from specjax.loaded import Drafter, Target
from specjax.sampling import SamplingConfig
from specjax.speculative import TreeSpec

__all__ = ["Chunk", "Drafter", "GenerationResult", "ModelConfig", "SamplingConfig", "Target",
           "TreeSpec", "convert", "generate", "load", "load_drafter", "stream"]
__version__ = "0.1.0"
