"""Serving engines measured with a drafter: the speedup where the drafter will run.

One module per engine (``vllm_engine``, ``llama_cpp_engine``); each measures, on the timed prompts, the target
alone, the target with each drafter at each K asked, the engine's own acceptance counters, whether the output
equals the engine's plain greedy output, and the engine's costs (its one-token step, its (K+1)-token
verification, the drafter's step), from which ``prediction`` predicts the speedup with draftsmith's exact tau.
Nothing here imports ``distill``.
"""

ENGINES = ("vllm", "llama_cpp")
