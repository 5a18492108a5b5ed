"""The model passes behind ``decode.acceptance``: the target's answers, batched, and teacher-forced passes.

* :func:`target_answers`: the target answers many prompts, left-padded batches of similar length
  through transformers' ``generate`` (greedy, or sampled with a seed).
* :func:`drafter_predictions`: one forward of the drafter over prompt + answer per prompt, in ragged
  right-padded batches of similar length with an attention mask; the LM head runs only on the answer
  positions.
* :func:`shared_body_predictions`: the same for drafters that differ only in their LM head (the stock
  drafter and its reduced-vocabulary heads): the decoder layers run once, each head on their output.
* :func:`sampling_betas`: the same pass through both models, ``beta_t = 1 - TV`` per answer position.
* :func:`answer_top_k`: one batch of that pass through the target, its k most likely tokens and their
  log-probabilities at every answer position (scoring answers that already exist, for distillation).

Pass the drafter as the decoder runs it (same dtype, int8 quantization, reduced vocabulary head): the
argmaxes are then the decoder's, up to the rounding of a full forward against the incremental one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from decode.model_calls import vocab_size_of
from decode.packing import packed_positions
from decode.progress import heartbeat
from decode.sampling import process_logits


def batches_by_length(lengths: Sequence[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Indices ``0..len(lengths)-1`` grouped into batches of similar length, shortest first: at most
    ``max_rows`` rows and at most ``max_tokens`` padded tokens (rows x longest length) each; a sequence
    longer than ``max_tokens`` gets a batch of its own.

    On a CPU a padded prompt token costs a full token of prefill compute, and prompt lengths of a mixed
    set span 30 to 2,000 tokens: batched in arrival order, most of the prefill is padding
    (docs/runs.md, "Batching by length").
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and ((len(current) + 1) * lengths[i] > max_tokens or len(current) == max_rows):
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


@torch.inference_mode()
def target_answers(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids: Sequence[int],
                   pad_token_id: int, batch_size: int = 8, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0, batch_tokens: int | None = None,
                   part: tuple[int, int] = (0, 1), progress: bool = True) -> list[list[int] | None]:
    """The target's answer to each prompt (token ids, up to and including the first EOS), in input order.

    Prompts of similar length share a left-padded batch of at most ``batch_size`` rows and, with
    ``batch_tokens``, at most that many padded prompt tokens (:func:`batches_by_length`); greedy unless
    ``temperature`` > 0 (then torch's global generator is seeded with ``seed`` per batch).

    ``part=(i, n)`` answers only batches i, i + n, ... of the same batching (one of n processes); the other
    prompts' entries are None, and the n parts together equal the whole, answer for answer.

    Raises:
        ValueError: batch_size < 1, or a part outside ``0 <= i < n``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampling = (dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0
                else dict(do_sample=False, temperature=None, top_k=None, top_p=None))
    eos, answers = set(eos_token_ids), [None] * len(prompts)
    batches = batches_by_length([len(p) for p in prompts], max_tokens=batch_tokens or 1 << 62, max_rows=batch_size)
    mine = _part(list(enumerate(batches)), part)  # numbered: a sampled batch's seed is its number
    bar = tqdm(total=sum(len(rows) for _, rows in mine), desc="target answers", unit="prompt", disable=not progress)
    with heartbeat(bar, target=target):
        for number, rows in mine:
            answers_batch = _generate_batch(target, prompts, rows, number, pad_token_id=pad_token_id,
                                            eos_token_ids=eos_token_ids, max_new_tokens=max_new_tokens,
                                            sampling=sampling, seed=seed, temperature=temperature)
            for i, row in zip(rows, answers_batch):
                end = next((j + 1 for j, token in enumerate(row) if token in eos), len(row))
                answers[i] = row[:end]
            bar.update(len(rows))
    bar.close()
    return answers


def _generate_batch(target, prompts: Sequence[Sequence[int]], rows: list[int], number: int, *, pad_token_id: int,
                    eos_token_ids: Sequence[int], max_new_tokens: int, sampling: dict, seed: int,
                    temperature: float) -> list[list[int]]:
    """One left-padded ``generate`` call over prompts ``rows``: each row's new tokens (up to max_new_tokens,
    EOS and padding after it included); a sampled batch seeds torch's generator with its ``number``."""
    width = max(len(prompts[i]) for i in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, i in enumerate(rows):
        ids[r, width - len(prompts[i]):] = torch.tensor(list(prompts[i]))
        mask[r, width - len(prompts[i]):] = 1
    if temperature > 0:
        torch.manual_seed(seed * 1_000_003 + number)
    out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                          max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids) or None,
                          pad_token_id=pad_token_id, repetition_penalty=1.0, **sampling)
    return [out[r, width:].tolist() for r in range(len(rows))]


def _part(batches: list, part: tuple[int, int]) -> list:
    """Batches i, i + n, ... of ``batches`` for ``part=(i, n)``: one process's share of a pass.

    Raises:
        ValueError: a part outside ``0 <= i < n``.
    """
    if not 0 <= part[0] < part[1]:
        raise ValueError(f"part must be (i, n) with 0 <= i < n, got {part}")
    return batches[part[0]::part[1]]


def _right_padded(sequences: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(sequences):
        ids[r, :len(s)] = torch.tensor(s)
        mask[r, :len(s)] = 1
    return ids.to(device), mask.to(device)


def _answer_logits(model, prompts: list[list[int]], answers: list[list[int]], vocab: int) -> list[torch.Tensor]:
    """Per prompt, the model's logits ``(len(answer), vocab)`` predicting each answer token (float32).

    The LM head runs on the answer positions only (``logits_to_keep`` as a ``(batch, seq)`` boolean mask,
    transformers 5), which also works through peft wrappers and replaced heads.
    """
    if not any(answers):
        return [torch.zeros(0, vocab) for _ in prompts]
    ids, mask = _right_padded([list(p) + list(a) for p, a in zip(prompts, answers)], model.device)
    keep = _answer_positions(prompts, answers, mask)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=keep).logits  # (N, V)
    return list(torch.split(logits[:, :vocab].float(), [len(a) for a in answers]))


def _packed_answer_logits(model, prompts: list[list[int]], answers: list[list[int]], rows: list[list[int]],
                          vocab: int) -> list[torch.Tensor]:
    """:func:`_answer_logits` with the sequences packed into ``rows`` (lists of sequence indices): per prompt,
    in input order, the logits ``(len(answer), vocab)`` predicting each answer token (float32)."""
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers)]
    positions, places = packed_positions(lengths, rows)  # refuses a bad layout
    if not any(answers):
        return [torch.zeros(0, vocab) for _ in prompts]
    ids = torch.zeros_like(positions)
    keep = torch.zeros_like(positions, dtype=torch.bool)
    for i, (r, start) in enumerate(places):
        ids[r, start:start + lengths[i]] = torch.tensor(prompts[i] + answers[i])
        keep[r, start + len(prompts[i]) - 1:start + lengths[i] - 1] = True
    device = model.device
    logits = model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False,
                   logits_to_keep=keep.to(device)).logits  # (answer tokens in packed row-major order, V)
    order = [i for row in rows for i in row]
    chunks = torch.split(logits[:, :vocab].float(), [len(answers[i]) for i in order])
    by_index = dict(zip(order, chunks))
    return [by_index[i] for i in range(len(prompts))]


def _answer_positions(prompts: list[list[int]], answers: list[list[int]], mask: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` bool: the positions whose next-token prediction is an answer token."""
    keep = torch.zeros_like(mask, dtype=torch.bool)
    for r, (p, a) in enumerate(zip(prompts, answers)):
        keep[r, len(p) - 1:len(p) - 1 + len(a)] = True
    return keep


def _answer_logits_per_head(body, heads: Sequence, prompts: list[list[int]], answers: list[list[int]],
                            vocab: int) -> list[list[torch.Tensor]]:
    """Per head, per prompt, the logits ``(len(answer), vocab)`` of ``head(body(prompt + answer))`` at the
    answer positions (float32): one pass of the decoder layers ``body`` for every head."""
    if not any(answers):
        return [[torch.zeros(0, vocab) for _ in prompts] for _ in heads]
    ids, mask = _right_padded([list(p) + list(a) for p, a in zip(prompts, answers)], body.device)
    hidden = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (batch, seq, H)
    kept = hidden[_answer_positions(prompts, answers, mask)]  # (answer tokens, H)
    sizes = [len(a) for a in answers]
    return [list(torch.split(head(kept)[:, :vocab].float(), sizes)) for head in heads]


def same_body(a, b) -> bool:
    """Whether drafters ``a`` and ``b`` (as the decoder runs them: int8 or float) have equal decoder layers,
    embeddings and norms, tensor for tensor and dtype for dtype, so that they differ at most in their LM head.
    Every tensor a module holds counts, registered or not (oneDNN-packed float32 weights,
    :mod:`decode.cpu_linear`, are plain attributes); one in a layout it cannot read counts as different."""
    if not (hasattr(a, "get_decoder") and hasattr(b, "get_decoder")):
        return False
    body_a, body_b = a.get_decoder(), b.get_decoder()
    # not the whole configs: a reduced head unties the head from the embeddings (tie_word_embeddings)
    if type(body_a) is not type(body_b) or a.config._attn_implementation != b.config._attn_implementation:
        return False
    modules_a, modules_b = dict(body_a.named_modules()), dict(body_b.named_modules())
    if modules_a.keys() != modules_b.keys():
        return False
    return all(_same_module_tensors(modules_a[name], modules_b[name]) for name in modules_a)


def _same_module_tensors(a, b) -> bool:
    """Equal own parameters, buffers and plain tensor attributes (a module's children are compared apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.ao.nn.quantized.dynamic.Linear):  # packed int8 weights: compare what they unpack to
        (wa, ba), (wb, bb) = a._weight_bias(), b._weight_bias()
        return torch.equal(wa.int_repr(), wb.int_repr()) and _same_scales(wa, wb) and _equal(ba, bb)
    own_a, own_b = _own_tensors(a), _own_tensors(b)
    return own_a.keys() == own_b.keys() and all(_equal(own_a[k], own_b[k]) for k in own_a)


def _own_tensors(module) -> dict[str, torch.Tensor]:
    hidden = {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}  # e.g. oneDNN-packed weights
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False)), **hidden}


def _equal(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    if x is None or y is None:
        return x is None and y is None
    if x.layout != y.layout or x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.layout == torch._mkldnn:  # oneDNN's packed float32 weights: the same packing of equal weights is equal
        x, y = x.to_dense(), y.to_dense()
    return x.layout == torch.strided and torch.equal(x, y)


def _same_scales(wa: torch.Tensor, wb: torch.Tensor) -> bool:
    if wa.qscheme() != wb.qscheme():
        return False
    if wa.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        return (torch.equal(wa.q_per_channel_scales(), wb.q_per_channel_scales())
                and torch.equal(wa.q_per_channel_zero_points(), wb.q_per_channel_zero_points()))
    return wa.q_scale() == wb.q_scale() and wa.q_zero_point() == wb.q_zero_point()


@torch.inference_mode()
def head_on_body_is_forward(drafter, probe_tokens: int = 8) -> bool:
    """Whether ``drafter``'s logits are its LM head on its decoder's last hidden state and nothing more (no
    softcapping or logit scaling after the head), checked on a short fixed input: what
    :func:`shared_body_predictions` computes in place of the forward."""
    if not (hasattr(drafter, "get_decoder") and hasattr(drafter, "get_output_embeddings")):
        return False
    device = next(drafter.parameters()).device
    ids = (torch.arange(probe_tokens, device=device) * 7 + 3)[None] % vocab_size_of(drafter)
    logits = drafter(input_ids=ids, use_cache=False).logits.float()
    split = drafter.get_output_embeddings()(drafter.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state)
    split = split.float()
    finite = torch.isfinite(logits)
    return bool(torch.equal(finite, torch.isfinite(split))
                and torch.allclose(logits[finite], split[finite], rtol=1e-4, atol=1e-4))


@torch.inference_mode()
def shared_body_predictions(drafters: Sequence, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                            *, vocab_size: int | None = None, batch_tokens: int = 4096, part: tuple[int, int] = (0, 1),
                            progress: bool = True) -> list[list[tuple[list[int], list[float]] | None]]:
    """:func:`drafter_predictions` of every drafter in ``drafters``, which share their decoder layers
    (:func:`same_body`; the first one's run, once per batch) and differ in their LM head: per drafter, the
    per-prompt ``(argmax (n,), probability (n,))``, as :func:`drafter_predictions` gives them (batches of
    ``batch_tokens`` prompt + answer tokens at most; ``part=(i, n)``: batches i, i + n, ... only, the others
    None). Pass only drafters for which :func:`head_on_body_is_forward` holds.

    Raises:
        ValueError: as :func:`drafter_predictions`, or no drafter given.
    """
    if not drafters:
        raise ValueError("shared_body_predictions needs at least one drafter")
    if len(prompts) != len(answers) or any(len(p) == 0 for p in prompts):
        raise ValueError("shared_body_predictions needs one answer per prompt and prompts of at least one token")
    vocab = vocab_size or vocab_size_of(drafters[0])
    body, heads = drafters[0].get_decoder(), [d.get_output_embeddings() for d in drafters]
    results: list[list] = [[None] * len(prompts) for _ in drafters]
    batches = _part(batches_by_length([len(p) + len(a) for p, a in zip(prompts, answers)], batch_tokens,
                                      max_rows=64), part)
    with tqdm(total=sum(len(answers[i]) for rows in batches for i in rows), unit="tok", disable=not progress,
              desc=f"teacher-forced drafters ({len(drafters)} heads, one body)") as bar, \
            heartbeat(bar, drafter=body):
        for rows in batches:
            per_head = _answer_logits_per_head(body, heads, [list(prompts[i]) for i in rows],
                                               [list(answers[i]) for i in rows], vocab)
            for d, logits in enumerate(per_head):
                for i, row_logits in zip(rows, logits):
                    top = torch.softmax(row_logits, -1).max(-1)
                    results[d][i] = (top.indices.tolist(), top.values.tolist())
            bar.update(sum(len(answers[i]) for i in rows))
    return results


@torch.inference_mode()
def drafter_predictions(drafter, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *,
                        vocab_size: int | None = None, batch_tokens: int = 4096, part: tuple[int, int] = (0, 1),
                        progress: bool = True) -> list[tuple[list[int], list[float]] | None]:
    """Per prompt, the drafter's argmax ``(n,)`` after prompt + ``answer[:t]`` and its softmax probability
    ``(n,)``, for each answer position t, over the first ``vocab_size`` logits (the vocabulary the decoder
    shares between the models; None = the drafter's).

    ``part=(i, n)`` computes only batches i, i + n, ... of the same batching (one of n processes); the other
    prompts' entries are None, and the n parts together equal the whole, entry for entry.

    Raises:
        ValueError: a prompt with no tokens, prompts and answers of different counts, or a part outside
            ``0 <= i < n``.
    """
    if len(prompts) != len(answers) or any(len(p) == 0 for p in prompts):
        raise ValueError("drafter_predictions needs one answer per prompt and prompts of at least one token")
    vocab = vocab_size or vocab_size_of(drafter)
    results: list = [None] * len(prompts)
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers)]
    batches = _part(batches_by_length(lengths, batch_tokens, max_rows=64), part)
    with tqdm(total=sum(len(answers[i]) for rows in batches for i in rows), desc="teacher-forced drafter",
              unit="tok", disable=not progress) as bar, heartbeat(bar, drafter=drafter):
        for rows in batches:
            logits = _answer_logits(drafter, [list(prompts[i]) for i in rows], [list(answers[i]) for i in rows], vocab)
            for i, row_logits in zip(rows, logits):
                top = torch.softmax(row_logits, -1).max(-1)
                results[i] = (top.indices.tolist(), top.values.tolist())
                bar.update(len(answers[i]))
    return results


@torch.inference_mode()
def answer_top_k(model, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], k: int, *,
                 packed_rows: Sequence[Sequence[int]] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One teacher-forced forward of ``model`` over a batch of prompt + answer (right-padded, attention mask,
    the LM head on answer positions only): per prompt, the ``k`` most likely next tokens and their
    log-probabilities (temperature 1, nats, float32, descending) at each answer position, as
    ``(ids (len(answer), k) int64, logprobs (len(answer), k) float32)``; row j is the distribution answer
    token j is scored under. Over the model's whole output width, as ``generate(output_logits=True)`` gives.

    ``packed_rows``: the sequences laid end to end instead of padded, one list of sequence indices per row
    (each index once), positions restarting at 0 per sequence and no attention mask, so that transformers
    builds a block-diagonal causal mask from the position ids. On a CPU a padded position costs a full token of
    compute, and a scoring batch of mixed lengths was mostly padding (docs/runs.md, "Scoring packed"). The caller
    makes sure the model keeps packed sequences apart (sdpa and eager attention do; flash attention only in one
    row).

    Raises:
        ValueError: an empty prompt, mismatched counts, k outside 1..output width, or ``packed_rows`` that do
            not hold every sequence exactly once.
    """
    width = vocab_size_of(model)
    if len(prompts) != len(answers) or any(len(p) == 0 for p in prompts) or not 1 <= k <= width:
        raise ValueError(f"answer_top_k needs one answer per non-empty prompt and 1 <= k <= {width}, got k={k}")
    prompts, answers = [list(p) for p in prompts], [list(a) for a in answers]
    if packed_rows is not None:
        logits = _packed_answer_logits(model, prompts, answers, [list(r) for r in packed_rows], width)
    else:
        logits = _answer_logits(model, prompts, answers, width)
    return [(top.indices, top.values) for top in (torch.log_softmax(x, -1).topk(k, dim=-1) for x in logits)]


@torch.inference_mode()
def sampling_betas(target, drafter, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *,
                   temperature: float, top_k: int = 0, top_p: float = 1.0, batch_tokens: int = 1024,
                   part: tuple[int, int] = (0, 1), progress: bool = True) -> list[list[float] | None]:
    """Per prompt, ``beta_t = sum_x min(p_target(x), q_draft(x)) = 1 - TV`` ``(n,)`` at each answer position,
    both distributions processed as the decoder samples (``decode.sampling.process_logits``) over the
    common vocabulary (Leviathan et al. 2023, Sec. 3, Lemma 3.3).

    ``part``: as in :func:`drafter_predictions`.

    Raises:
        ValueError: temperature <= 0 (greedy needs no betas), mismatched inputs or a bad part.
    """
    if temperature <= 0:
        raise ValueError("sampling_betas needs temperature > 0")
    if len(prompts) != len(answers):
        raise ValueError("sampling_betas needs one answer per prompt")
    vocab = min(vocab_size_of(target), vocab_size_of(drafter))
    results: list = [None] * len(prompts)
    batches = _part(batches_by_length([len(p) + len(a) for p, a in zip(prompts, answers)], batch_tokens,
                                      max_rows=16), part)
    bar = tqdm(batches, desc="teacher-forced betas", unit="batch", disable=not progress)
    with heartbeat(bar, target=target, drafter=drafter):
        for rows in bar:
            batch_prompts, batch_answers = [list(prompts[i]) for i in rows], [list(answers[i]) for i in rows]
            target_logits = _answer_logits(target, batch_prompts, batch_answers, vocab)
            draft_logits = _answer_logits(drafter, batch_prompts, batch_answers, vocab)
            for i, t_logits, d_logits in zip(rows, target_logits, draft_logits):
                target_probs = process_logits(t_logits, temperature, top_k, top_p)
                draft_probs = process_logits(d_logits, temperature, top_k, top_p)
                results[i] = torch.minimum(target_probs, draft_probs).sum(-1).clamp(0.0, 1.0).tolist()
    return results
