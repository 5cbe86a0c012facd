"""bench vocab's pooling, report and plot on synthetic per-prompt records (no model)."""

from __future__ import annotations

from specjax.bench.vocab import plot_vocab, summarize, summary

TASKS = ["qa", "rag"]


def record(task: str, accepted: int, forwards: int, mismatch=None) -> dict:
    head = {"tokens": [1] * 9, "new_tokens": 9, "decode_s": 1.0, "target_forwards": forwards,
            "accepted_tokens": accepted, "mean_accepted_length": accepted / forwards,
            "mean_shortlist_size": 100.0, "shortlist_coverage": 0.5, "mismatch_at": mismatch}
    return {"task": task, "vanilla": {"new_tokens": 9, "decode_s": 0.5}, "fr:8": head}


def test_pooled_mal_is_tokens_per_forward_and_mismatches_count():
    recs = [record("qa", 6, 4), record("qa", 2, 2), record("rag", 9, 3, mismatch=5)]
    s = summarize(recs, "fr:8", {"best_ms": 5.0}, {"best_ms": 10.0}, TASKS)
    assert s["mal"] == 17 / 9
    assert s["mal_per_task"] == {"qa": 8 / 6, "rag": 3.0}
    assert s["draft_speedup_vs_full"] == 2.0 and s["greedy_matches"] == 2
    assert s["decode_tokens_per_s"] == 24 / 3


def test_report_and_plot(tmp_path):
    recs = [record("qa", 6, 4), record("rag", 9, 3)]
    head = summarize(recs, "fr:8", {"best_ms": 5.0}, None, TASKS)
    head["speedup_vs_vanilla"] = 0.5
    r = {"config": {"tasks": TASKS}, "heads": {"fr:8": head},
         "vanilla": {"decode_tokens_per_s": 16.0},
         "router_overlap": [{"k": 1, "layer": 1.0, "router": 0.2, "both": 1.2,
                             "overlapped": False}]}
    text = summary(r)
    assert "| fr:8 | 2.14 |" in text and "not overlapped" in text
    assert plot_vocab(r, tmp_path / "v.png").stat().st_size > 0


def test_router_overlap_times_the_layer_and_router_on_real_weights(tiny_target, fitted_drafter):
    """The overlap check runs on the tiny models, with the weights and cache as arguments (a
    closed-over embedding would let XLA fold the gather at compile time)."""
    from specjax.bench.vocab import router_overlap
    from tests.vocab.test_heads import example_heads

    head = example_heads(tiny_target.params.head, fr_rows=8)["dynaspec-pa"]
    got = router_overlap(tiny_target, fitted_drafter, head, k=2, context=16, runs=3)
    assert {"layer", "router", "both", "saved_ms", "noise_ms"} <= set(got)
    assert all(got[name] > 0 for name in ("layer", "router", "both"))
