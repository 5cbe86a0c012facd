"""The compiled loop names its phases, so a profile shows what eager mode times."""

from __future__ import annotations

import jax

import specjax
from specjax.runner import Request, SpecRunner
from specjax.sampling import SamplingConfig
from specjax.speculative import spec_loop
from specjax.vocab import resolve_head

PHASES = ("draft", "verify", "accept", "compact", "catch_up", "commit")


def test_the_compiled_loop_names_every_phase(tiny_target, fitted_drafter):
    sampling = SamplingConfig()
    runner = SpecRunner.of(tiny_target, fitted_drafter,
                           resolve_head("full", tiny_target, fitted_drafter),
                           specjax.TreeSpec("chain", depth=2), sampling)
    req = Request.build(tiny_target, [[5, 6, 7]], max_new_tokens=8, sampling=sampling,
                        stop_on_eos=True, key=jax.random.PRNGKey(0), tree=runner.spec.tree)
    state = runner.prefill(req)
    text = spec_loop.lower(tiny_target.params, fitted_drafter.params, runner.head, state,
                           spec=runner.spec).as_text(debug_info=True)
    # Op locations read ".../while/body/<phase>/...": the names a profiler shows.
    missing = [p for p in PHASES if f"/{p}/" not in text]
    assert not missing, missing
