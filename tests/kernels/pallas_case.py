"""The base of every kernel's test class, as in jax's ``tests/pallas/gpu_ops_test.py``: one
class holds the cases and runs them compiled (a GPU backend; skipped elsewhere), and an
``...Interpret`` subclass with ``INTERPRET = True`` reruns them in the Pallas interpreter on
any backend."""

from __future__ import annotations

import pytest

from specjax.compat import pallas_gpu_available


class PallasCase:
    """Set ``KERNEL = staticmethod(<the Pallas entry point taking interpret=>)``."""

    INTERPRET = False
    KERNEL = None

    @pytest.fixture(autouse=True)
    def _backend(self):
        if not self.INTERPRET and not pallas_gpu_available():
            pytest.skip("compiled Triton kernels need a GPU (run with JAX_PLATFORMS=cuda)")

    def pallas(self, *args, **kwargs):
        return self.KERNEL(*args, interpret=self.INTERPRET, **kwargs)
