"""The speedup an engine should give, from draftsmith's exact tau and the engine's own measured costs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from decode.metrics import predicted_speedup


def engine_cost_ratios(costs: Mapping[str, Any]) -> tuple[float, dict[int, float]]:
    """c and the verification costs in the engine's units, from its measured seconds.

    Args:
        costs: ``{"target_step_s", "drafter_step_s", "verify_s": {n: s}, "one_token_forward_s"}``: the target's
            decoding step (s/token), the drafter's, the target's forward over n new tokens on a cached prefix and
            the same over 1 new token (s).

    Returns:
        (c = drafter step / target step, {K: target forward over K + 1 tokens / 1-token forward}).
    """
    c = costs["drafter_step_s"] / costs["target_step_s"]
    one = costs["one_token_forward_s"]
    return c, {int(n) - 1: s / one for n, s in costs["verify_s"].items() if int(n) > 1}


def predict_engine_speedups(per_k: Mapping[str, Mapping[str, float]], costs: Mapping[str, Any]) -> dict[int, float]:
    """Predicted speedup over the engine's target alone at each K with a measured verification cost.

    tau / (K c + v(K)) (Leviathan et al. 2023, Theorem 3.8, with tau simulated exactly per K by draftsmith and c,
    v measured in the engine: :func:`decode.metrics.predicted_speedup`).

    Args:
        per_k: evaluate's ``simulated["per_k"]``: ``{"K": {"mean_accepted_tokens", "mean_draft_length"?}}``.
        costs: as :func:`engine_cost_ratios` reads them.

    Returns:
        {K: predicted speedup} for every K both ``per_k`` and ``costs["verify_s"]`` cover.
    """
    c, verify = engine_cost_ratios(costs)
    out = {}
    for k, v in sorted(verify.items()):
        sim = per_k.get(str(k)) or per_k.get(k)
        if sim:
            mean_k = sim.get("mean_draft_length", k)
            out[k] = predicted_speedup(sim["mean_accepted_tokens"], mean_k, c, v)
    return out
