"""decode.eagle3: the EAGLE-3 head's decoder is lossless and its exact simulation equals the decoder's blocks
(tiny random Qwen2 targets, float32, seeded)."""

import pytest
import torch
from tiny_models import tiny_qwen2

from decode.eagle3.decoding import eagle3_generate
from decode.eagle3.head import Eagle3Config, Eagle3Head, default_aux_layers, is_eagle3_folder
from decode.eagle3.simulation import (expected_head_sampling_blocks, head_block_drafts,
                                      simulate_head_greedy)
from decode.speculative import target_generate

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 12
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 9, 1, 10, 2, 5, 6, 11, 0, 4]]


def random_head(target, seed: int, draft_to_target=None, scale: float = 1.0) -> Eagle3Head:
    torch.manual_seed(seed)
    size = None if draft_to_target is None else len(draft_to_target)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=size), draft_to_target)
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2 * scale)
    return head.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(4, 0, vocab_size=VOCAB, head_scale=6.0)


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, 1, scale=3.0)


def greedy_reference(target, prompt, max_new_tokens=30, eos=()):
    return target_generate(target, torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                           eos_token_ids=list(eos)).new_tokens.tolist()


def test_default_aux_layers_follow_specforge():
    assert default_aux_layers(28) == [1, 13, 24]
    assert default_aux_layers(24) == [1, 11, 20]
    with pytest.raises(ValueError):
        Eagle3Config.from_target(tiny_qwen2(2, 0, vocab_size=VOCAB).config, aux_layers=[0, 5])


@pytest.mark.parametrize("draft_length", [1, 3, 5])
def test_greedy_equals_target(target, head, draft_length):
    for prompt in PROMPTS:
        out = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=draft_length,
                              max_new_tokens=30, eos_token_ids=[])
        assert out.new_tokens.tolist() == greedy_reference(target, prompt)
        assert sum(a + 1 for a in out.stats.accepted_per_block) == 30


def test_reduced_vocabulary_head_is_lossless(target):
    head = random_head(target, 2, torch.tensor([0, 2, 3, 5, 8, 11]), scale=3.0)
    for prompt in PROMPTS:
        out = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=4, max_new_tokens=25,
                              eos_token_ids=[])
        assert out.new_tokens.tolist() == greedy_reference(target, prompt, 25)
        drafts, _ = head_block_drafts(target, head, prompt, out.new_tokens.tolist(), 4)
        assert all(d in {0, 2, 3, 5, 8, 11} for block in drafts for d in block)


def test_eos_and_max_new_tokens_cut_blocks(target, head):
    prompt = PROMPTS[0]
    reference = greedy_reference(target, prompt)
    eos = reference[7]
    out = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=5, max_new_tokens=30,
                          eos_token_ids=[eos])
    assert out.new_tokens.tolist() == reference[: reference.index(eos) + 1]
    for max_new in (0, 1, 2, 7):
        out = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=5, max_new_tokens=max_new,
                              eos_token_ids=[])
        assert out.new_tokens.tolist() == reference[:max_new]


def test_simulation_equals_decoder_blocks(target, head):
    """The simulated blocks are the decoder's, block for block, at every K; some blocks accept several."""
    longest = 0
    for prompt in PROMPTS:
        for k in (1, 2, 4, 6):
            out = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=k, max_new_tokens=30,
                                  eos_token_ids=[])
            drafts, _ = head_block_drafts(target, head, prompt, out.new_tokens.tolist(), k)
            stats = simulate_head_greedy(drafts, out.new_tokens.tolist(), draft_length=k, max_new_tokens=30)
            assert stats.accepted_per_block == out.stats.accepted_per_block
            assert stats.drafted_per_block == out.stats.drafted_per_block
            longest = max(longest, *out.stats.accepted_per_block)
    assert longest >= 2


def test_entries_pair_a_token_with_the_state_that_predicted_it(target):
    """Entry s reads the target's state at s, which predicted x[s + 1], the token it is given: a head whose
    first step passes that state through the target's own norm and LM head drafts the token before the one
    it should, at every block start (the indexing of features, tokens and drafts)."""
    config = Eagle3Config.from_target(target.config, aux_layers=[3, 3, 3])
    head = Eagle3Head(config).eval()
    hidden = config.hidden_size
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
    prompt = PROMPTS[2]
    answer = greedy_reference(target, prompt)
    drafts, _ = head_block_drafts(target, head, prompt, answer, 1)
    assert [d[0] for d in drafts[1:]] == answer[:-1]


def test_seeded_sampling_reproduces_and_stays_in_vocabulary(target, head):
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(5)
        runs.append(eagle3_generate(target, head, torch.tensor([PROMPTS[0]]), draft_length=3, max_new_tokens=20,
                                    eos_token_ids=[], temperature=0.8, top_p=0.95,
                                    generator=generator).new_tokens.tolist())
    assert runs[0] == runs[1] and all(0 <= t < VOCAB for t in runs[0])


@pytest.mark.slow
def test_second_token_follows_target_distribution():
    """Sampled output follows the target: the second emitted token (drafted by the head's first step from
    the target's states) over 1,500 seeded runs, vocabulary 6, against the target's exact marginal."""
    vocab, runs, temperature = 6, 1500, 1.0
    small = tiny_qwen2(3, 0, vocab_size=vocab, head_scale=3.0)
    head = random_head(small, 3, scale=3.0)
    prompt = torch.tensor([[2, 4]])
    with torch.no_grad():
        first = torch.softmax(small(prompt).logits[0, -1] / temperature, -1)
        second = torch.zeros(vocab)
        for token in range(vocab):
            logits = small(torch.cat([prompt, torch.tensor([[token]])], 1)).logits[0, -1]
            second += first[token] * torch.softmax(logits / temperature, -1)
    counts = torch.zeros(vocab)
    generator = torch.Generator().manual_seed(0)
    for _ in range(runs):
        out = eagle3_generate(small, head, prompt, draft_length=2, max_new_tokens=2, eos_token_ids=[],
                              temperature=temperature, generator=generator)
        counts[out.new_tokens[1]] += 1
    empirical = counts / runs
    assert 0.5 * (empirical - second).abs().sum() < 0.06
    chi_square = (runs * (empirical - second) ** 2 / second).sum().item()
    assert chi_square < 20.52  # 5 degrees of freedom, p = 0.001


def test_expected_sampling_blocks_bounds():
    ones = expected_head_sampling_blocks([[1.0] * 3] * 9, draft_length=3, max_new_tokens=9)
    assert ones.blocks == pytest.approx(3.0)  # blocks of 3 accepted + 1
    zeros = expected_head_sampling_blocks([[0.0] * 3] * 9, draft_length=3, max_new_tokens=9)
    assert zeros.blocks == pytest.approx(9.0)
    half = expected_head_sampling_blocks([[0.5] * 2] * 4, draft_length=2, max_new_tokens=4)
    assert 2.0 < half.blocks < 4.0


def test_save_and_load_round_trip(target, head, tmp_path):
    head.save(tmp_path / "head")
    assert is_eagle3_folder(tmp_path / "head")
    loaded = Eagle3Head.load(tmp_path / "head")
    for prompt in PROMPTS:
        a = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=3, max_new_tokens=12,
                            eos_token_ids=[])
        b = eagle3_generate(target, loaded, torch.tensor([prompt]), draft_length=3, max_new_tokens=12,
                            eos_token_ids=[])
        assert a.new_tokens.tolist() == b.new_tokens.tolist()
        assert a.stats.accepted_per_block == b.stats.accepted_per_block


def test_report_sections_replay_the_head(target, head):
    """decode.acceptance's simulated_section on HeadTeacherForced samples gives the decoder's tau at K."""
    from decode.acceptance import SimulationSettings, simulated_section
    from decode.eagle3.simulation import head_teacher_forced

    samples, decoded = [], []
    for i, prompt in enumerate(PROMPTS):
        out = eagle3_generate(target, head, torch.tensor([prompt]), draft_length=3, max_new_tokens=30,
                              eos_token_ids=[])
        decoded.append(out.stats)
        samples.append(head_teacher_forced(target, head, str(i), "c", prompt, out.new_tokens.tolist(), steps=8))
    section, _ = simulated_section(samples, SimulationSettings(draft_length=3, max_new_tokens=30), max_k=8,
                                   cost_ratio=0.1, verify_costs=[1.0] * 9)
    blocks = sum(len(s.accepted_per_block) for s in decoded)
    assert section["mean_accepted_tokens"] == pytest.approx(90 / blocks)
    assert section["per_k"]["3"]["mean_accepted_tokens"] == pytest.approx(90 / blocks)
    assert 1 <= section["recommended_draft_length"] <= 8 and "heuristic" in section


def test_sampling_betas_are_one_minus_tv_at_each_block_start(target, head):
    """betas[p][0] = sum min(target, head) of the first draft of the block at answer position p (temperature 1):
    the head's step 1 at entry prompt_len + p - 2 against the target's distribution at prompt_len + p - 1."""
    from decode.eagle3.features import teacher_forced_states
    from decode.eagle3.unroll import unroll

    prompt = PROMPTS[0]
    answer = greedy_reference(target, prompt, 8)
    _, betas = head_block_drafts(target, head, prompt, answer, 2,
                                 sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0})
    assert [len(b) for b in betas] == [2] * 8
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits, states = teacher_forced_states(target, ids, head.config.aux_layers)
        head_probs = torch.softmax(head.lm_head(unroll(head, target.get_input_embeddings(), ids, states, 1)[0][0]), -1)
        target_probs = torch.softmax(logits[0], -1)
    for p in range(8):
        s = len(prompt) + p - 2
        assert betas[p][0] == pytest.approx(float(torch.minimum(head_probs[s], target_probs[s + 1]).sum()), abs=1e-5)
