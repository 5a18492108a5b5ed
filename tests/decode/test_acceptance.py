"""decode.acceptance: simulated blocks equal the decoder's, exactly (greedy, prompt lookup), and the sampling
expectation matches seeded decoder runs; on tiny random models in float32."""

from __future__ import annotations

import copy

import pytest
import torch

from decode.acceptance import (
    BlockTotals,
    SimulationSettings,
    TeacherForced,
    bootstrap_ci,
    expected_sampling_blocks,
    figures,
    DrafterCosts,
    drafter_costs,
    paired_speedup_ratio,
    paired_tau_difference,
    simulate_greedy,
    simulate_prompt_lookup,
    simulated_section,
)
from decode.metrics import DecodeStats
from decode.prompt_lookup import PromptLookupDrafter, lookup_draft
from decode.speculative import speculative_generate, target_generate
from decode.teacher_forcing import batches_by_length, drafter_predictions, sampling_betas, target_answers
from tests.decode.test_speculative import tiny_model
from tiny_models import tiny_qwen2

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64
PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 10, 25, 3, 3, 3, 9, 12, 61, 20, 5], [11, 12, 13, 11, 12], [5, 5, 5, 5]]


def perturbed(model, scale: float, seed: int):
    """``model`` with Gaussian noise of ``scale`` x each weight's std added: a drafter that agrees often."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in other.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * scale)
    return other


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(2, seed=0, vocab_size=VOCAB, head_scale=3.0)
    return target, perturbed(target, 0.05, seed=1)


def teacher_forced(target, drafter, max_new_tokens, eos):
    samples = []
    for i, prompt in enumerate(PROMPTS):
        answer = target_generate(target, torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                 eos_token_ids=eos).new_tokens.tolist()
        samples.append((prompt, answer))
    predictions = drafter_predictions(drafter, [p for p, _ in samples], [a for _, a in samples], progress=False)
    return [TeacherForced(str(i), "code", p, a, tokens, probs)
            for i, ((p, a), (tokens, probs)) in enumerate(zip(samples, predictions))]


@pytest.mark.parametrize("max_new_tokens, eos", [(40, []), (13, []), (40, "mid-answer")])
def test_greedy_blocks_equal_the_decoders(pair, max_new_tokens, eos):
    target, drafter = pair
    if eos == "mid-answer":  # a token the first prompt's answer reaches mid-way: an EOS inside a block
        reference = target_generate(target, torch.tensor([PROMPTS[0]]), max_new_tokens=40, eos_token_ids=[])
        eos = [reference.new_tokens.tolist()[17]]
    samples = teacher_forced(target, drafter, max_new_tokens, eos)
    lengths = set()
    for sample in samples:
        for k in range(1, 9):
            for schedule in ("constant", "heuristic"):
                out = speculative_generate(target, drafter, torch.tensor([sample.prompt]), draft_length=k,
                                           schedule=schedule, max_new_tokens=max_new_tokens, eos_token_ids=eos)
                simulated = simulate_greedy(sample, draft_length=k, schedule=schedule, max_new_tokens=max_new_tokens)
                assert out.new_tokens.tolist() == sample.answer
                assert simulated.accepted_per_block == out.stats.accepted_per_block, (sample.prompt_id, k, schedule)
                assert simulated.drafted_per_block == out.stats.drafted_per_block
                assert simulated.mean_accepted_tokens == out.stats.mean_accepted_tokens
                lengths.update(out.stats.accepted_per_block)
    assert lengths >= set(range(0, 9))  # blocks of every length occur: the comparison has teeth


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_confidence_threshold_blocks_equal_the_decoders(pair, threshold):
    target, drafter = pair
    for sample in teacher_forced(target, drafter, 40, []):
        for k in (2, 4, 8):
            out = speculative_generate(target, drafter, torch.tensor([sample.prompt]), draft_length=k,
                                       max_new_tokens=40, eos_token_ids=[], confidence_threshold=threshold)
            simulated = simulate_greedy(sample, draft_length=k, max_new_tokens=40, confidence_threshold=threshold)
            assert simulated.accepted_per_block == out.stats.accepted_per_block
            # drafts after a block's first rejection are not simulated: a lower bound there
            assert all(s <= d for s, d in zip(simulated.drafted_per_block, out.stats.drafted_per_block))


def test_a_drafter_equal_to_the_target_accepts_everything(pair):
    target, _ = pair
    sample = teacher_forced(target, target, 30, [])[2]
    stats = simulate_greedy(sample, draft_length=4, max_new_tokens=30)
    assert stats.acceptance_rate == 1.0 and stats.accepted_per_block == [4] * 6 and stats.new_tokens == 30


def test_lookup_draft_follows_transformers_rule():
    assert lookup_draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]        # bigram match, earliest first
    assert lookup_draft([1, 2, 3, 9, 1, 2], 10) == [3, 9, 1, 2]    # cut at the context's end
    assert lookup_draft([4, 7, 5, 7, 6, 8, 7], 2) == [5, 7]        # no bigram: unigram 7, earliest
    assert lookup_draft([1, 2, 3], 3) == []                         # nothing repeats
    assert lookup_draft([5, 5], 4) == [5]
    assert lookup_draft([1, 2, 1], 0) == []


def test_prompt_lookup_decoder_is_exact_and_simulated_exactly(pair):
    target, _ = pair
    lookup = PromptLookupDrafter(max_ngram=2)
    drafted_any = False
    for prompt in PROMPTS:
        reference = target_generate(target, torch.tensor([prompt]), max_new_tokens=40, eos_token_ids=[])
        for k in (1, 3, 5):
            out = speculative_generate(target, lookup, torch.tensor([prompt]), draft_length=k, max_new_tokens=40,
                                       eos_token_ids=[])
            assert out.new_tokens.tolist() == reference.new_tokens.tolist()
            simulated = simulate_prompt_lookup(prompt, reference.new_tokens.tolist(), draft_length=k,
                                               max_new_tokens=40)
            assert simulated.accepted_per_block == out.stats.accepted_per_block
            assert simulated.drafted_per_block == out.stats.drafted_per_block
            drafted_any |= sum(out.stats.accepted_per_block) > 0
    assert drafted_any  # the tiny model repeats itself, so lookup drafts do get accepted


def test_prompt_lookup_samples_from_the_target():
    # one-hot drafts through speculative sampling: the output law is the target's (same seed -> same output
    # as a seeded decoder would not promise, so compare token frequencies at the first position instead)
    target = tiny_model(1, seed=3, vocab_size=8, head_scale=0.5)
    prompt = torch.tensor([[1, 2, 1, 2, 1]])
    counts_spec, counts_target = torch.zeros(8), torch.zeros(8)
    for seed in range(600):
        gen = torch.Generator().manual_seed(seed)
        out = speculative_generate(target, PromptLookupDrafter(), prompt, draft_length=3, max_new_tokens=3,
                                   eos_token_ids=[], temperature=1.0, generator=gen)
        counts_spec[out.new_tokens[1]] += 1
        gen = torch.Generator().manual_seed(10_000 + seed)
        ref = target_generate(target, prompt, max_new_tokens=3, eos_token_ids=[], temperature=1.0, generator=gen)
        counts_target[ref.new_tokens[1]] += 1
    total_variation = 0.5 * (counts_spec / 600 - counts_target / 600).abs().sum()
    assert total_variation < 0.12  # two samples of 600 from one law; a wrong residual gives far more


def test_expected_sampling_blocks_edge_cases():
    assert expected_sampling_blocks([1.0] * 12, draft_length=3, max_new_tokens=12).blocks == pytest.approx(3.0)
    never = expected_sampling_blocks([0.0] * 12, draft_length=3, max_new_tokens=12)
    assert never.blocks == pytest.approx(12.0) and never.drafted == pytest.approx(9 * 3 + 2 + 1 + 0)  # K shrinks near the limit
    # i.i.d. alpha, far from the end: tau -> (1 - a^(K+1)) / (1 - a) (Leviathan et al. 2023, Eq. 1)
    long = expected_sampling_blocks([0.6] * 4000, draft_length=4, max_new_tokens=4000)
    assert long.tokens / long.blocks == pytest.approx((1 - 0.6 ** 5) / 0.4, rel=2e-3)
    with pytest.raises(ValueError):
        expected_sampling_blocks([0.5] * 5, draft_length=2, max_new_tokens=4)


def test_sampling_expectation_matches_seeded_decoder_runs():
    """Mean tokens per target forward of many seeded decoder runs vs the simulated expectation over as many
    target-sampled answers; bound: 4 standard errors of the two means plus 3% for the path approximation
    (the betas are read along target-sampled contexts; accepted drafts lean toward tokens both models like)."""
    target = tiny_model(2, seed=0, vocab_size=12, head_scale=2.0)
    drafter = perturbed(target, 0.5, seed=4)
    prompt, runs, new = [3, 1, 4, 1, 5], 200, 16
    decoder_tau, simulated_tau = [], []
    answers = []
    for seed in range(runs):
        gen = torch.Generator().manual_seed(seed)
        out = speculative_generate(target, drafter, torch.tensor([prompt]), draft_length=3, max_new_tokens=new,
                                   eos_token_ids=[], temperature=1.0, generator=gen)
        decoder_tau.append(out.stats.new_tokens / len(out.stats.accepted_per_block))
        gen = torch.Generator().manual_seed(50_000 + seed)
        answers.append(target_generate(target, torch.tensor([prompt]), max_new_tokens=new, eos_token_ids=[],
                                       temperature=1.0, generator=gen).new_tokens.tolist())
    betas = sampling_betas(target, drafter, [prompt] * runs, answers, temperature=1.0, progress=False)
    for beta in betas:
        expected = expected_sampling_blocks(beta, draft_length=3, max_new_tokens=new)
        simulated_tau.append(expected.tokens / expected.blocks)
    mean_d, mean_s = sum(decoder_tau) / runs, sum(simulated_tau) / runs
    se = (torch.tensor(decoder_tau).var() / runs + torch.tensor(simulated_tau).var() / runs).sqrt().item()
    assert 1.3 < mean_d < 3.7  # neither trivial nor perfect agreement
    assert abs(mean_d - mean_s) < 4 * se + 0.03 * mean_d, (mean_d, mean_s, se)


@pytest.mark.parametrize("max_tokens, max_rows", [(1 << 62, 3), (40, 8), (12, 2), (1, 4)])
def test_batches_by_length_hold_every_index_once_within_their_limits(max_tokens, max_rows):
    lengths = [int(n) for n in torch.randint(1, 30, (41,), generator=torch.Generator().manual_seed(2))]
    batches = batches_by_length(lengths, max_tokens, max_rows)
    assert sorted(sum(batches, [])) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths)  # shortest first, so a batch's rows are of similar length
    for b in batches:
        assert len(b) <= max_rows and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= max_tokens)
    # greedy packing: the next sequence would not have fitted into the batch before it
    for before, after in zip(batches, batches[1:]):
        assert len(before) == max_rows or (len(before) + 1) * lengths[after[0]] > max_tokens


@pytest.mark.parametrize("batch_tokens", [None, 12])
def test_target_answers_batched_equal_batch_one(pair, batch_tokens):
    target, _ = pair
    batched = target_answers(target, PROMPTS, max_new_tokens=20, eos_token_ids=[9], pad_token_id=0, batch_size=3,
                             batch_tokens=batch_tokens, progress=False)
    for prompt, answer in zip(PROMPTS, batched):
        alone = target_generate(target, torch.tensor([prompt]), max_new_tokens=20, eos_token_ids=[9])
        assert answer == alone.new_tokens.tolist()


def test_drafter_predictions_batched_equal_one_by_one(pair):
    target, drafter = pair
    answers = [target_generate(target, torch.tensor([p]), max_new_tokens=12, eos_token_ids=[]).new_tokens.tolist()
               for p in PROMPTS]
    together = drafter_predictions(drafter, PROMPTS, answers, progress=False)
    for prompt, answer, (tokens, probs) in zip(PROMPTS, answers, together):
        alone_tokens, alone_probs = drafter_predictions(drafter, [prompt], [answer], progress=False)[0]
        assert tokens == alone_tokens and len(tokens) == len(answer)
        assert probs == pytest.approx(alone_probs, abs=1e-5)


def _totals(blocks):
    stats = DecodeStats(draft_length=3, accepted_per_block=list(blocks), drafted_per_block=[3] * len(blocks))
    stats.new_tokens = sum(blocks) + len(blocks)
    return BlockTotals.of(stats), stats


def test_intervals_cover_and_pair():
    good = [_totals([3, 3, 2, 3]), _totals([3, 1, 3]), _totals([2, 3, 3, 3]), _totals([3, 3])] * 10
    bad = [_totals([1, 0, 2, 1]), _totals([0, 1, 1]), _totals([1, 1, 0, 2]), _totals([2, 0])] * 10
    pooled = figures([t for t, _ in good])
    merged = DecodeStats.merge([s for _, s in good])
    assert pooled["acceptance_rate"] == pytest.approx(merged.acceptance_rate)
    assert pooled["mean_accepted_tokens"] == pytest.approx(merged.mean_accepted_tokens)
    assert pooled["ci95"]["acceptance_rate"][0] <= merged.acceptance_rate <= pooled["ci95"]["acceptance_rate"][1]
    lo, hi = pooled["ci95"]["mean_accepted_tokens"]
    assert lo < merged.mean_accepted_tokens < hi and hi - lo < 0.5
    difference = paired_tau_difference([t for t, _ in good], [t for t, _ in bad])
    assert difference["mean_accepted_tokens"] == pytest.approx(
        merged.mean_accepted_tokens - DecodeStats.merge([s for _, s in bad]).mean_accepted_tokens)
    assert difference["ci95"][0] > 0  # separated
    assert paired_tau_difference([t for t, _ in good], [t for t, _ in good])["ci95"] == [0.0, 0.0]
    with pytest.raises(ValueError):
        paired_tau_difference([t for t, _ in good], [t for t, _ in bad[:3]])
    assert bootstrap_ci(lambda rows: 1.0, 5) == [1.0, 1.0]


def test_paired_speedup_ratio_is_the_cost_models_ratio_with_a_paired_interval():
    same = [_totals([3, 3, 2, 3]), _totals([3, 1, 3]), _totals([2, 3, 3, 3]), _totals([3, 0])] * 10
    totals = [t for t, _ in same]
    cheap, dear = DrafterCosts(cost_ratio=0.1, verify_cost=1.2), DrafterCosts(cost_ratio=0.2, verify_cost=1.2)
    tokens, blocks, drafted = (sum(getattr(t, key) for t in totals) for key in ("tokens", "blocks", "drafted"))
    expected = (tokens / (0.1 * drafted + 1.2 * blocks)) / (tokens / (0.2 * drafted + 1.2 * blocks))
    ratio = paired_speedup_ratio(totals, cheap, totals, dear)
    # the same blocks at a lower c: the ratio is fixed by the costs, so every resample gives nearly the same
    assert ratio["ratio"] == pytest.approx(expected) and ratio["ratio"] > 1
    assert ratio["ci95"][0] > 1 and ratio["ci95"][1] - ratio["ci95"][0] < 0.02
    assert ratio["ci95"] == ratio["ci95_prompts_only"] and ratio["interval_covers"] == "prompts (costs held fixed)"
    same_costs = paired_speedup_ratio(totals, cheap, totals, cheap)
    assert same_costs["ratio"] == 1.0 and same_costs["ci95"] == [1.0, 1.0]
    with pytest.raises(ValueError):
        paired_speedup_ratio(totals, cheap, totals[:3], dear)


def test_the_ratios_interval_resamples_the_timing_rounds_with_the_prompts():
    """c timed in rounds that disagree (a's and b's rounds disturbed in turn): the interval that resamples the
    rounds with the prompts spans both orders, where the one that holds the medians fixed stays tight."""
    totals = [t for t, _ in [_totals([3, 3, 2, 3]), _totals([3, 1, 3]), _totals([2, 3, 3, 3])] * 10]
    rounds_a, rounds_b = (0.5, 0.1, 0.5, 0.1, 0.5), (0.1, 0.5, 0.1, 0.5, 0.1)
    a = drafter_costs(0.5, [1.0, 1.1, 1.2, 1.3], 3, cost_ratio_rounds=rounds_a)
    b = drafter_costs(0.1, [1.0, 1.1, 1.2, 1.3], 3, cost_ratio_rounds=rounds_b)
    assert a.rounds == (5, 1) and a.verify_cost == 1.3
    ratio = paired_speedup_ratio(totals, a, totals, b)
    assert ratio["ratio"] < 0.7 and ratio["ci95_prompts_only"][1] < 0.7  # today's reading: "slower", tightly
    assert ratio["ci95"][0] < 0.7 and ratio["ci95"][1] > 1.4  # the rounds' disagreement, both ways
    assert ratio["interval_covers"] == "prompts and timing rounds"
    # rounds that agree leave the interval where the prompts put it
    steady = paired_speedup_ratio(totals, drafter_costs(0.5, None, 3, cost_ratio_rounds=(0.5,) * 5),
                                  totals, drafter_costs(0.1, None, 3, cost_ratio_rounds=(0.1,) * 5))
    assert steady["ci95"] == pytest.approx(steady["ci95_prompts_only"], abs=0.01)
    with pytest.raises(ValueError, match="different rounds"):
        paired_speedup_ratio(totals, a, totals, drafter_costs(0.1, None, 3, cost_ratio_rounds=(0.1,) * 4))


def test_verification_rounds_are_scaled_to_the_smoothed_cost():
    rounds = [[1.0, 1.2, 1.6], [1.0, 1.4, 1.8], [1.0, 1.3, 1.7]]
    costs = drafter_costs(0.2, [1.0, 1.3, 1.5], 2, verify_cost_rounds=rounds)
    assert costs.verify_cost == 1.5 and costs.rounds == (1, 3)
    assert costs.verify_cost_rounds == pytest.approx((1.5 * 1.6 / 1.7, 1.5 * 1.8 / 1.7, 1.5))
    assert costs.resampled([0], [1, 1, 1]) == DrafterCosts(0.2, pytest.approx(1.5 * 1.8 / 1.7))


def test_simulated_section_fields(pair):
    target, drafter = pair
    samples = teacher_forced(target, drafter, 40, [])
    section, totals = simulated_section(samples, SimulationSettings(draft_length=3, max_new_tokens=40),
                                        cost_ratio=0.2, verify_costs=[1.0, 1.1, 1.2, 1.3, 1.4])
    assert section["num_prompts"] == len(PROMPTS) == len(totals)
    assert section["num_tokens"] == sum(len(s.answer) for s in samples)
    assert set(section["per_k"]) == {str(k) for k in range(1, 17)}
    k3 = section["per_k"]["3"]
    assert k3["mean_accepted_tokens"] == section["mean_accepted_tokens"]
    assert k3["predicted_speedup"] == pytest.approx(section["mean_accepted_tokens"]
                                                    / (section["mean_draft_length"] * 0.2 + 1.3))
    assert 1 <= section["recommended_draft_length"] <= 16
    best = section["per_k"][str(section["recommended_draft_length"])]["predicted_speedup"]
    lo, hi = section["ci95"]["predicted_speedup_at_best_k"]
    assert lo <= best <= hi
    matches = [m for s in samples for m in s.matches]
    assert section["top1_agreement"] == pytest.approx(sum(matches) / len(matches))
    assert section["per_category"]["code"]["num_prompts"] == len(PROMPTS)
    assert len(section["ci95"]["mean_accepted_tokens"]) == 2 and "heuristic" in section


@pytest.mark.real
@pytest.mark.slow
def test_real_qwen_simulated_blocks_equal_the_decoders(qwen05):
    """The shipped 0.5B (float32) as target, a copy with 12% weight noise as a drafter that agrees often:
    blocks simulated from one batched teacher-forced pass equal the decoder's, prompt by prompt."""
    model, tokenizer = qwen05
    drafter = perturbed(model, 0.12, seed=0).eval()
    eos = [tokenizer.eos_token_id]
    prompts = [tokenizer(text).input_ids for text in ("def quicksort(items):\n", "The three laws of motion are")]
    answers = target_answers(model, prompts, max_new_tokens=32, eos_token_ids=eos, pad_token_id=eos[0],
                             batch_size=1, progress=False)
    predictions = drafter_predictions(drafter, prompts, answers, progress=False)
    decoded = []
    for prompt, answer, (tokens, probs) in zip(prompts, answers, predictions):
        sample = TeacherForced("p", "code", prompt, answer, tokens, probs)
        for k in (2, 4):
            out = speculative_generate(model, drafter, torch.tensor([prompt]), draft_length=k, max_new_tokens=32,
                                       eos_token_ids=eos)
            assert out.new_tokens.tolist() == answer
            simulated = simulate_greedy(sample, draft_length=k, max_new_tokens=32)
            assert simulated.accepted_per_block == out.stats.accepted_per_block
            decoded.append(out.stats)
    print("acceptance", DecodeStats.merge(decoded[1::2]).acceptance_rate)
    assert 0.2 < DecodeStats.merge(decoded[1::2]).acceptance_rate < 0.98  # K = 4: neither all nor nothing


def test_distill_validation_simulates_the_decoder(pair):
    from distill.training.loop import simulated_validation

    target, drafter = pair
    examples = []
    for prompt in PROMPTS:
        out = target_generate(target, torch.tensor([prompt]), max_new_tokens=20, eos_token_ids=[])
        examples.append({"prompt_ids": prompt, "completion_ids": out.new_tokens.tolist(), "temperature": 0.0,
                         "finish_reason": "length"})
    figures = simulated_validation(drafter, examples, draft_length=3)
    decoded = DecodeStats.merge([speculative_generate(target, drafter, torch.tensor([e["prompt_ids"]]), draft_length=3,
                                                      max_new_tokens=20, eos_token_ids=[]).stats for e in examples])
    assert figures["simulated_tau"] == pytest.approx(decoded.mean_accepted_tokens)
    assert figures["simulated_acceptance"] == pytest.approx(decoded.acceptance_rate)
    assert simulated_validation(drafter, [{**examples[0], "temperature": 0.7}], draft_length=3) == {}


def test_simulated_section_with_a_capped_heuristic_and_sampling_settings(pair):
    from types import SimpleNamespace

    from distill.measure.simulation import settings_of

    target, drafter = pair
    samples = teacher_forced(target, drafter, 40, [])
    capped = SimulationSettings(draft_length=2, max_new_tokens=40, schedule="heuristic", max_draft_length=4)
    section, _ = simulated_section(samples, capped)  # K up to 16 beside a cap of 4: no error
    assert len(section["per_k"]) == 16 and section["schedule"] == "heuristic"
    decode_cfg = SimpleNamespace(schedule="heuristic", draft_length=3, max_new_tokens=40, max_draft_length=6,
                                 confidence_threshold=0.4, temperature=0.8)
    sampled = settings_of(decode_cfg, {"draft_length": 3})
    assert (sampled.schedule, sampled.confidence_threshold, sampled.sampling) == ("constant", 0.0, True)


def test_the_recommended_k_comes_from_the_simulated_figures_not_the_timed_extrapolation():
    from distill.measure.simulation import simulated_choice

    timed = {"best_draft_length": 6, "rule_of_thumb": 4, "cost_ratio": 0.1, "verify_costs": {1: 1.0},
             "speculation_pays": True, "measured_positions": 3, "expected_speedup_by_k": {6: 2.5}}
    section = {"num_prompts": 128, "recommended_draft_length": 2,
               "per_k": {"1": {"predicted_speedup": 1.2}, "2": {"predicted_speedup": 1.5},
                         "3": {"predicted_speedup": 1.4}}}
    choice = simulated_choice(section, timed)
    assert choice["best_draft_length"] == 2 and choice["expected_speedup_by_k"] == {1: 1.2, 2: 1.5, 3: 1.4}
    assert choice["timed_best_draft_length"] == 6 and "measured_positions" not in choice
    assert choice["source"] == "simulated on 128 prompts" and choice["speculation_pays"]
    slow = {**section, "recommended_draft_length": 1, "per_k": {"1": {"predicted_speedup": 0.8}}}
    assert not simulated_choice(slow, timed)["speculation_pays"]
    assert simulated_choice({"per_k": {}}, timed) is timed  # nothing simulated: the timed choice stays


@pytest.mark.parametrize("quantization", ["none", "int8-dynamic"])
def test_shared_body_pass_equals_each_drafters_own(pair, quantization):
    from decode.quantization import drafter_for_decoding
    from decode.teacher_forcing import head_on_body_is_forward, same_body, shared_body_predictions
    from distill.measure.simulation import shared_body_groups
    from distill.models.reduced_vocab import reduce_vocabulary

    target, drafter = pair
    whole = drafter_for_decoding(copy.deepcopy(drafter), quantization)
    kept = torch.tensor(sorted(set(range(0, VOCAB, 2)) | set(range(40, VOCAB))))  # a reduced head of 44 rows
    reduced = drafter_for_decoding(reduce_vocabulary(copy.deepcopy(drafter), kept), quantization)
    other = drafter_for_decoding(perturbed(drafter, 0.05, seed=7), quantization)
    assert same_body(whole, reduced) and not same_body(whole, other)
    # LoRA merged into the linear layers alone (embeddings and norms untouched) still differs
    merged_like = copy.deepcopy(drafter)
    with torch.no_grad():
        merged_like.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    assert not same_body(whole, drafter_for_decoding(merged_like, quantization))
    assert head_on_body_is_forward(whole) and head_on_body_is_forward(reduced)
    tied = tiny_qwen2(2, seed=3, vocab_size=VOCAB, tie_word_embeddings=True)  # as the shipped 0.5B: reducing unties
    assert same_body(drafter_for_decoding(copy.deepcopy(tied), quantization),
                     drafter_for_decoding(reduce_vocabulary(copy.deepcopy(tied), kept), quantization))
    assert shared_body_groups({"a": whole, "b": other, "c": reduced}) == [["a", "c"], ["b"]]
    answers = [target_generate(target, torch.tensor([p]), max_new_tokens=12, eos_token_ids=[]).new_tokens.tolist()
               for p in PROMPTS]
    shared = shared_body_predictions([whole, reduced], PROMPTS, answers, vocab_size=VOCAB, progress=False)
    for model, per_prompt in zip((whole, reduced), shared):
        for (tokens, probs), (own_tokens, own_probs) in zip(per_prompt, drafter_predictions(
                model, PROMPTS, answers, vocab_size=VOCAB, progress=False)):
            assert tokens == own_tokens
            assert probs == pytest.approx(own_probs, abs=1e-5)
    assert shared[0] != shared[1]  # the heads differ: the reduced one cannot name the odd tokens below 40
    assert all(t % 2 == 0 or t >= 40 for tokens, _ in shared[1] for t in tokens)


def test_a_drafter_whose_logits_are_more_than_its_head_runs_its_own_pass(pair):
    from decode.teacher_forcing import head_on_body_is_forward
    from distill.measure.simulation import shared_body_groups

    _, drafter = pair
    capped = copy.deepcopy(drafter)
    plain_forward = capped.forward

    def softcapped(*args, **kwargs):  # as Gemma-style final-logit softcapping does after the head
        out = plain_forward(*args, **kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    capped.forward = softcapped
    assert head_on_body_is_forward(drafter) and not head_on_body_is_forward(capped)
    assert shared_body_groups({"plain": drafter, "capped": capped}) == [["plain"], ["capped"]]
