"""specjax: speculative decoding for large-vocabulary LLMs in JAX.

Top-level API::

    specjax.convert(src, out)            # HF folder or GGUF -> specjax folder
    target = specjax.load(out)
    result = specjax.generate(target, "Hello", max_new_tokens=64)
    drafter = specjax.load_drafter(path, target)
    result = specjax.generate(target, "Hello", drafter=drafter, tree=specjax.TreeSpec())
"""

from specjax.api import Drafter, GenerationResult, Target, generate, load, load_drafter
from specjax.config import ModelConfig
from specjax.convert import convert
from specjax.sampling import SamplingConfig
from specjax.speculative import TreeSpec

__all__ = ["Drafter", "GenerationResult", "ModelConfig", "SamplingConfig", "Target", "TreeSpec",
           "convert", "generate", "load", "load_drafter"]
__version__ = "0.1.0"
