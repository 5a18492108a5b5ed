"""Exact checks of the distillation losses (distill/training/losses.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from distill.training.losses import LOSS_KINDS, distillation_loss, expected_acceptance, per_token_divergence

B, T, V = 2, 5, 11


pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture
def student():
    return _logits(0)


@pytest.fixture
def target():
    return _logits(1)


@pytest.fixture
def mask():
    m = torch.ones(B, T, dtype=torch.bool)
    m[0, :2] = False  # "prompt"
    m[1, -1] = False  # "padding"
    return m


@pytest.fixture
def labels():
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))


def _reference_kl(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per position in float64."""
    logp_a, logp_b = logp_a.double(), logp_b.double()
    return (logp_a.exp() * (logp_a - logp_b)).sum(-1)


@pytest.mark.parametrize("kind,beta", [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.0), ("jsd", 0.1),
                                       ("jsd", 0.5), ("jsd", 0.9), ("jsd", 1.0)])
def test_identical_logits_give_zero(target, mask, kind, beta):
    loss = distillation_loss(target.clone(), target, mask, kind=kind, jsd_beta=beta)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item()) < 1e-6


def test_identical_logits_accept_everything(target, mask):
    acc = expected_acceptance(target.clone(), target, mask)
    assert torch.allclose(acc[mask], torch.ones(int(mask.sum())), atol=1e-6)
    assert torch.all(acc[~mask] == 0)


def test_fkl_is_true_kl(student, target, mask):
    loss = distillation_loss(student, target, mask, kind="fkl")
    student_logp, target_logp = F.log_softmax(student, -1), F.log_softmax(target, -1)
    # torch reference: kl_div(input=log q, target=log p) = sum p (log p - log q)
    ref = F.kl_div(student_logp[mask], target_logp[mask], reduction="batchmean", log_target=True)
    assert torch.allclose(loss, ref, atol=1e-6)
    # KL(p || q) = H(p, q) - H(p): cross-entropy minus the target entropy (not cross-entropy alone)
    target_probs = target_logp.exp()
    cross_entropy = -(target_probs * student_logp).sum(-1)[mask].mean()
    entropy = -(target_probs * target_logp).sum(-1)[mask].mean()
    assert torch.allclose(loss, cross_entropy - entropy, atol=1e-5)
    assert loss.item() < cross_entropy.item() - 0.1


def test_rkl_is_reverse(student, target, mask):
    loss = distillation_loss(student, target, mask, kind="rkl")
    ref = _reference_kl(F.log_softmax(student, -1), F.log_softmax(target, -1))[mask].mean()
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-5)
    assert not math.isclose(loss.item(), distillation_loss(student, target, mask, kind="fkl").item(), rel_tol=1e-3)


def test_jsd_endpoints_are_fkl_and_rkl(student, target, mask):
    fkl = distillation_loss(student, target, mask, kind="fkl")
    rkl = distillation_loss(student, target, mask, kind="rkl")
    assert torch.equal(distillation_loss(student, target, mask, kind="jsd", jsd_beta=0.0), fkl)
    assert torch.equal(distillation_loss(student, target, mask, kind="jsd", jsd_beta=1.0), rkl)
    # continuous at the ends: the scaled JSD tends to FKL as beta -> 0 and RKL as beta -> 1 (the gap
    # shrinks like O(beta), with a constant set by the chi-square divergence, so it is slow)
    gaps0, gaps1 = [], []
    for eps in (1e-2, 1e-3, 1e-4, 1e-5):
        gaps0.append(abs(distillation_loss(student, target, mask, kind="jsd", jsd_beta=eps).item() - fkl.item()))
        gaps1.append(abs(distillation_loss(student, target, mask, kind="jsd", jsd_beta=1 - eps).item() - rkl.item()))
    assert gaps0 == sorted(gaps0, reverse=True) and gaps0[-1] < 1e-3 * fkl.item()
    assert gaps1 == sorted(gaps1, reverse=True) and gaps1[-1] < 1e-3 * rkl.item()


def test_jsd_matches_gkd_definition_scaled(student, target, mask):
    beta = 0.3
    target_probs = F.softmax(target.double(), -1)
    draft_probs = F.softmax(student.double(), -1)
    mixture = beta * target_probs + (1 - beta) * draft_probs
    gkd = (beta * _reference_kl(target_probs.log(), mixture.log())
           + (1 - beta) * _reference_kl(draft_probs.log(), mixture.log()))[mask].mean()
    loss = distillation_loss(student, target, mask, kind="jsd", jsd_beta=beta)
    assert math.isclose(loss.item(), gkd.item() / (beta * (1 - beta)), rel_tol=1e-4)


def test_tvd_is_one_minus_overlap(student, target, mask):
    target_probs, draft_probs = F.softmax(target, -1), F.softmax(student, -1)
    overlap = torch.minimum(target_probs, draft_probs).sum(-1)
    tvd = per_token_divergence(student, target, kind="tvd")
    assert torch.allclose(tvd, 1 - overlap, atol=1e-6)
    loss = distillation_loss(student, target, mask, kind="tvd")
    assert torch.allclose(loss, (1 - overlap)[mask].mean(), atol=1e-6)
    acc = expected_acceptance(student, target, mask)
    assert acc.shape == (B, T)
    assert torch.allclose(acc[mask], overlap[mask], atol=1e-6)
    assert torch.all(acc[~mask] == 0)


def test_ce_is_cross_entropy_on_labels(student, target, mask, labels):
    loss = distillation_loss(student, target, mask, kind="ce", labels=labels)
    ref = F.cross_entropy(student[mask], labels[mask])
    assert torch.allclose(loss, ref, atol=1e-6)
    with pytest.raises(ValueError, match="labels"):
        distillation_loss(student, target, mask, kind="ce")


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_masked_positions_are_ignored(student, target, mask, labels, kind):
    loss = distillation_loss(student, target, mask, kind=kind, labels=labels)
    garbage_student, garbage_target = student.clone(), target.clone()
    garbage_student[~mask] = float("nan")
    garbage_target[~mask] = 1e4
    assert torch.equal(distillation_loss(garbage_student, garbage_target, mask, kind=kind, labels=labels), loss)
    # token-weighted mean over the selected positions only
    per_token = per_token_divergence(student, target, kind=kind, labels=labels)
    assert torch.allclose(loss, per_token[mask].mean(), atol=1e-6)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_padding_vocab_rows_are_sliced(student, target, mask, labels, kind):
    loss = distillation_loss(student, target, mask, kind=kind, labels=labels)
    padded_student = torch.cat([student, torch.full((B, T, 5), 50.0)], dim=-1)  # huge logits on pad rows
    padded_target = torch.cat([target, torch.full((B, T, 2), -3.0)], dim=-1)
    assert torch.allclose(distillation_loss(padded_student, target, mask, kind=kind, labels=labels), loss)
    assert torch.allclose(distillation_loss(student, padded_target, mask, kind=kind, labels=labels), loss)
    assert torch.allclose(expected_acceptance(padded_student, target, mask), expected_acceptance(student, target, mask))
    # both padded: the common min(V) columns count, here V + 2 (so the student's first 2 pad rows do)
    both = distillation_loss(padded_student, padded_target, mask, kind=kind, labels=labels)
    assert torch.allclose(both, distillation_loss(padded_student[..., :V + 2], padded_target, mask, kind=kind,
                                                  labels=labels))


def test_temperature_scales_both_distributions(student, target, mask):
    loss = distillation_loss(student, target, mask, kind="fkl", temperature=2.0)
    assert torch.allclose(loss, distillation_loss(student / 2, target / 2, mask, kind="fkl"), atol=1e-6)


def test_low_precision_inputs_computed_in_float32(student, target, mask):
    loss = distillation_loss(student.bfloat16(), target.bfloat16(), mask, kind="fkl")
    ref = distillation_loss(student.bfloat16().float(), target.bfloat16().float(), mask, kind="fkl")
    assert loss.dtype == torch.float32 and torch.equal(loss, ref)


@pytest.mark.parametrize("kind,beta", [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("ce", 0.5), ("jsd", 0.0),
                                       ("jsd", 0.5), ("jsd", 1.0)])
def test_gradients_are_finite(target, mask, labels, kind, beta):
    student = (_logits(3, scale=30.0)).requires_grad_(True)  # peaked distributions, tiny probabilities
    loss = distillation_loss(student, target * 15, mask, kind=kind, jsd_beta=beta, labels=labels)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
    assert student.grad[~mask].abs().sum() == 0  # no gradient into masked positions
    assert student.grad[mask].abs().sum() > 0


def test_empty_mask_gives_zero_with_graph(student, target):
    student = student.requires_grad_(True)
    loss = distillation_loss(student, target, torch.zeros(B, T, dtype=torch.bool), kind="fkl")
    loss.backward()
    assert loss.item() == 0.0 and torch.all(student.grad == 0)


def test_bad_arguments(student, target, mask):
    with pytest.raises(ValueError, match="kind"):
        distillation_loss(student, target, mask, kind="kl")
    with pytest.raises(ValueError, match="jsd_beta"):
        distillation_loss(student, target, mask, kind="jsd", jsd_beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(student, target, mask, kind="fkl", temperature=0.0)
    with pytest.raises(ValueError, match="shapes"):
        distillation_loss(student, target[:, :-1], mask, kind="fkl")


@pytest.mark.parametrize("kind,beta", [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.0), ("jsd", 0.5),
                                       ("jsd", 1.0)])
@pytest.mark.parametrize("side", ["student", "target"])
def test_nan_at_a_counted_position_propagates(student, target, mask, kind, beta, side):
    bad = (student if side == "student" else target).clone()
    bad[1, 0, 3] = float("nan")  # mask[1, 0] is True
    args = (bad, target) if side == "student" else (student, bad)
    assert torch.isnan(distillation_loss(*args, mask, kind=kind, jsd_beta=beta))


def test_zero_probability_tokens(mask):
    target = torch.zeros(B, T, V)
    target[..., 0] = -float("inf")  # a token the target never emits (p = 0 exactly)
    student = _logits(4).requires_grad_(True)
    for kind, beta in (("fkl", 0.5), ("jsd", 0.0), ("jsd", 0.5), ("tvd", 0.5)):
        loss = distillation_loss(student, target, mask, kind=kind, jsd_beta=beta)
        (grad,) = torch.autograd.grad(loss, student)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (kind, beta)
    # KL(q || p) is infinite when the drafter puts mass where the target has none
    assert distillation_loss(student, target, mask, kind="rkl") == float("inf")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("reduced", [False, True])
def test_top_k_buckets_in_one_pass_equal_the_log_softmax_ones_with_their_gradients(temperature, reduced):
    """The drafter's k + 1 buckets, formed without a (N, vocab) log-softmax, equal the textbook formula (log-softmax,
    then the rest's log-sum-exp over the other tokens), values and gradients, with and without -inf columns."""
    from distill.training.losses import top_k_log_probs
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    if reduced:
        logits[:, 30:] = float("-inf")  # a reduced head: tokens 30.. cannot be drafted
    ids = torch.stack([torch.randperm(50, generator=gen)[:5] for _ in range(6)])
    ids[0] = torch.arange(30, 35) if reduced else ids[0]  # a row whose stored tokens are all impossible
    target = torch.log_softmax(torch.randn(6, 50, generator=gen), -1).gather(-1, ids)

    def reference(x):
        full = F.log_softmax(x / temperature, dim=-1)
        return full.gather(-1, ids), torch.logsumexp(full.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True)

    fast_in, slow_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fast = top_k_log_probs(fast_in, ids, target, temperature=temperature, drop_impossible=False)[0]
    top, rest = reference(slow_in)
    slow = torch.cat([top, rest], -1)
    finite = torch.isfinite(slow)
    assert torch.equal(finite, torch.isfinite(fast))
    torch.testing.assert_close(fast[finite], slow[finite], rtol=0, atol=1e-5)
    weights = torch.randn(slow.shape, generator=gen)
    fast[finite].mul(weights[finite]).sum().backward()
    slow[finite].mul(weights[finite]).sum().backward()
    assert torch.isfinite(fast_in.grad).all()
    torch.testing.assert_close(fast_in.grad, torch.nan_to_num(slow_in.grad), rtol=0, atol=1e-5)


def test_draft_indices_map_target_ids_to_columns_and_the_rest_one_past():
    from distill.models.reduced_vocab import draft_indices
    kept = torch.tensor([2, 5, 7, 40])
    assert draft_indices(torch.tensor([[5, 40, 0], [7, 41, 2]]), kept).tolist() == [[1, 3, 4], [2, 4, 0]]


@pytest.mark.parametrize("kind", ["fkl", "jsd", "rkl", "ce"])
def test_top_k_loss_on_draft_vocabulary_columns_equals_it_on_full_logits(kind):
    """A reduced drafter's (N, D) logits with the stored ids mapped give the loss, its gradient and the acceptance
    of its full (N, V) logits (-inf outside the set), including stored ids and labels outside the set."""
    from distill.training.losses import top_k_distillation_loss
    gen = torch.Generator().manual_seed(1)
    vocab, kept = 60, torch.tensor(sorted(torch.randperm(60, generator=gen)[:25].tolist()))
    reduced = torch.randn(7, kept.numel(), generator=gen) * 2
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:6] for _ in range(7)])
    ids[0, :3] = kept[:3]
    target = torch.log_softmax(torch.randn(7, vocab, generator=gen), -1).gather(-1, ids).sort(-1, descending=True)[0]
    labels = torch.cat([kept[:4], torch.tensor([i for i in range(vocab) if i not in kept.tolist()][:3])])

    def full_logits(x):
        return x.new_full((7, vocab), float("-inf")).index_copy(-1, kept, x)

    on_draft, on_full = reduced.clone().requires_grad_(), reduced.clone().requires_grad_()
    loss_d, accept_d = top_k_distillation_loss(on_draft, ids, target, kind=kind, labels=labels, draft_to_target=kept)
    loss_f, accept_f = top_k_distillation_loss(full_logits(on_full), ids, target, kind=kind, labels=labels)
    torch.testing.assert_close(loss_d, loss_f, rtol=0, atol=1e-5)
    torch.testing.assert_close(accept_d, accept_f, rtol=0, atol=1e-6)
    loss_d.sum().backward()
    loss_f.sum().backward()
    torch.testing.assert_close(on_draft.grad, on_full.grad, rtol=0, atol=1e-5)
