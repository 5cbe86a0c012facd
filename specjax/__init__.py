"""specjax: speculative decoding for large-vocabulary LLMs in JAX.

Top-level API::

    specjax.convert(src, out)            # HF folder or GGUF -> specjax folder
    target = specjax.load(out)
    result = specjax.generate(target, "Hello", max_new_tokens=64)
"""

from specjax.api import GenerationResult, Target, generate, load
from specjax.config import ModelConfig
from specjax.convert import convert
from specjax.sampling import SamplingConfig

__all__ = ["GenerationResult", "ModelConfig", "SamplingConfig", "Target", "convert", "generate",
           "load"]
__version__ = "0.1.0"
