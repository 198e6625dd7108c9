"""What users rely on from sampling: seeds reproduce, filters hold, logprobs are exact."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from engine.errors import ParamError
from engine.rules import TokenRules
from engine.sampler import Sampler, SamplingRow, apply_penalties, inverse_cdf, make_generator, top_k_top_p
from engine.sampling_params import SamplingParams
from kernels import cpu


EOS = 0
VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """These tensors are tiny: waking a thread pool costs far more than the work,
    and on a loaded machine each op can wait milliseconds for busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def row(
    gen: torch.Generator | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **kw: object,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), gen, prompt or [], output or [])


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=make_generator(seed)) * 3


def probs_of(logprobs: list[float]) -> torch.Tensor:
    """Logits [1, len] whose softmax is exactly the given distribution."""
    return torch.tensor([[math.log(p) for p in logprobs]])


def draw(logits: torch.Tensor, n: int, seed: int = 0, **kw: object) -> list[int]:
    """n independent draws from one distribution, as one batch of unseeded rows."""
    return Sampler([EOS], seed=seed)(logits.expand(n, -1), [row(**kw) for _ in range(n)]).token_ids


def test_greedy_is_argmax_and_uses_no_randomness() -> None:
    logits = random_logits(6, seed=1)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1  # a tie: the lower id wins
    s = Sampler([EOS])
    gen = make_generator(7)
    before, own = s.generator.get_state(), gen.get_state()
    rows = [row(temperature=0.0) for _ in range(5)] + [row(gen, temperature=0.0)]
    out = s(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.token_ids[3] == 5
    assert torch.equal(s.generator.get_state(), before) and torch.equal(gen.get_state(), own)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 49152, 49155])
def test_the_native_argmax_gives_torchs_indices(vocab: int) -> None:
    """Greedy rows on CPU take kernels/csrc/sample.cpp: ties go to the lower id, a NaN
    counts as the largest (its first one), an all -inf row gives 0, as torch.argmax."""
    x = random_logits(12, seed=vocab, vocab=vocab)
    x[1] = -torch.inf
    x[2] = 3.0
    if vocab > 3:
        x[3, vocab // 2] = x[3, vocab - 1] = float("nan")
        x[4, vocab - 1] = x[4].max() + 1
        x[5, 2] = x[5, vocab - 2] = x[5].max() + 1
        x[6] = float("nan")
        x[7, 0] = x[7, vocab - 1] = torch.inf
    assert torch.equal(cpu.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(cpu.argmax_rows(x[:, :0].new_empty(0, vocab)), torch.empty(0, dtype=torch.long))
    with pytest.raises(RuntimeError, match="fp32 logits"):
        cpu.argmax_rows(x.double())


def test_processing_leaves_the_logits_as_they_were() -> None:
    """Rows without a rule read the logits in place; a rule on any row works on a copy."""
    logits = random_logits(3, seed=4)
    before = logits.clone()
    s = Sampler([EOS])
    plain = s(logits, [row(temperature=0.0) for _ in range(3)])
    biased = s(logits, [row(temperature=0.0), row(temperature=0.0, logit_bias={7: 100.0}), row(temperature=0.0)])
    assert torch.equal(logits, before)
    assert plain.token_ids == logits.argmax(dim=-1).tolist()
    assert biased.token_ids == [plain.token_ids[0], 7, plain.token_ids[2]]


def test_greedy_rows_unaffected_by_random_neighbours() -> None:
    logits = random_logits(4, seed=2)
    rows = [row(temperature=0.0), row(temperature=1.5, top_p=0.5),
            row(temperature=0.0), row(top_k=3)]
    out = Sampler([EOS])(logits, rows).token_ids
    assert [out[0], out[2]] == [logits[0].argmax().item(), logits[2].argmax().item()]


def seeded_run(
    seed: int, steps: int, neighbours: list[SamplingRow], at: int, **kw: object
) -> list[int]:
    """Tokens of one seeded request over many steps, sharing its batch at position `at`."""
    s = Sampler([EOS], seed=99)
    mine = row(make_generator(seed), **kw)
    tokens = []
    for step in range(steps):
        rows = neighbours[:at] + [mine] + neighbours[at:]
        logits = random_logits(len(rows), seed=1000 + step)
        logits[at] = random_logits(1, seed=step)[0]  # the request's own logits
        tokens.append(s(logits, rows).token_ids[at])
        mine.output_token_ids.append(tokens[-1])
    return tokens


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05}])
def test_seeded_request_independent_of_batch(kw: dict) -> None:
    alone = seeded_run(42, 40, [], 0, **kw)
    assert len(set(alone)) > 5  # really random, not stuck on one token
    assert seeded_run(42, 40, [], 0, **kw) == alone  # reproducible
    others = [row(), row(temperature=0.0), row(make_generator(3), top_k=5), row(top_p=0.3),
              row(repetition_penalty=1.3, presence_penalty=0.5), row(min_p=0.2)]
    for at in (0, 3, 6):
        assert seeded_run(42, 40, others, at, **kw) == alone
    assert seeded_run(43, 40, others, 2, **kw) != alone  # and the seed matters


def test_unseeded_sampler_seed_reproducible() -> None:
    logits = random_logits(8, seed=5)
    a = Sampler([EOS], seed=1)(logits, [row() for _ in range(8)]).token_ids
    b = Sampler([EOS], seed=1)(logits, [row() for _ in range(8)]).token_ids
    assert a == b


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    tokens = draw(logits, 20000, temperature=temperature)
    # 4 degrees of freedom: chi-square above 18.5 has probability 0.001.
    assert chi_square(tokens, probs) < 18.5


def test_seeded_generator_draws_match_softmax() -> None:
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.3]])
    s = Sampler([EOS])
    tokens = [s(logits, [row(make_generator(i))]).token_ids[0] for i in range(4000)]
    assert chi_square(tokens, torch.softmax(logits[0], dim=-1)) < 16.3  # 3 dof, p = 0.001


def test_top_k_1_is_greedy() -> None:
    logits = random_logits(32, seed=3)
    logits[0, 7] = logits[0, 11] = logits[0].max() + 1
    out = Sampler([EOS])(logits, [row(top_k=1, temperature=1.7) for _ in range(32)]).token_ids
    assert out == logits.argmax(dim=-1).tolist()


DIST = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    "kw, kept",
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.45}, {0}),
        ({"top_p": 0.75}, {0, 1}),  # 0.5 < 0.75 <= 0.8
        ({"top_p": 0.9}, {0, 1, 2}),
        ({"top_p": 0.97}, {0, 1, 2, 3}),
        ({"min_p": 0.2}, {0, 1, 2}),  # floor 0.1
        ({"min_p": 0.5}, {0, 1}),  # floor 0.25
        ({"top_k": 3, "top_p": 0.9, "min_p": 0.5}, {0, 1}),
    ],
)
def test_filters_keep_exactly_the_documented_set(kw: dict, kept: set[int]) -> None:
    tokens = draw(probs_of(DIST), 3000, **kw)
    assert set(tokens) == kept


def test_top_p_renormalises_over_the_kept_set() -> None:
    tokens = draw(probs_of(DIST), 20000, seed=3, top_p=0.75)
    assert chi_square(tokens, torch.tensor([0.625, 0.375, 0.0, 0.0])[:2]) < 10.8  # 1 dof


def test_repetition_penalty_follows_transformers() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0]])
    apply_penalties(x, [row(prompt=[0, 1], output=[2], repetition_penalty=2.0)])
    # Seen tokens (prompt and output): positive logits divided, negative multiplied.
    assert x.tolist() == [[1.0, -4.0, 0.5, -1.0, 3.0]]


def test_frequency_and_presence_penalties_count_output_only() -> None:
    x = torch.zeros(1, 5)
    r = row(prompt=[4, 4], output=[1, 2, 2, 2], frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(x, [r])
    assert x.tolist() == [[0.0, -0.75, -1.75, 0.0, 0.0]]


def test_penalties_leave_other_rows_alone() -> None:
    x = random_logits(3, seed=4)
    before = x.clone()
    rows = [row(output=[1, 2]), row(output=[1, 2], presence_penalty=1.0), row(output=[5])]
    apply_penalties(x, rows)
    assert torch.equal(x[0], before[0]) and torch.equal(x[2], before[2])
    assert not torch.equal(x[1], before[1])


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    s = Sampler([EOS])
    assert s(logits, [row(output=[1], temperature=0.0)]).token_ids == [1]
    assert s(logits, [row(output=[1], temperature=0.0, frequency_penalty=1.5)]).token_ids == [2]
    assert s(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=1.3)]).token_ids == [2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_tokens(temperature: float) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0
    logits[0, 9] = 49.0
    s = Sampler([EOS, 3])
    kw = {"temperature": temperature, "min_tokens": 3, "stop_token_ids": [9]}
    for done in range(3):
        tok = s(logits, [row(output=[5] * done, **kw)]).token_ids[0]
        assert tok not in (EOS, 3, 9)
    # Reached: eos and stop tokens are allowed again (eos is greedy's pick).
    tok = s(logits, [row(output=[5] * 3, **kw)]).token_ids[0]
    assert tok == EOS if temperature == 0 else tok in (EOS, 9)


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(4, seed=6).to(torch.bfloat16)
    gen = make_generator(1)
    rows = [
        row(logprobs=5, temperature=0.3, repetition_penalty=1.5, output=[1, 2]),
        row(temperature=0.0),
        row(gen, logprobs=0, top_k=3),
        row(logprobs=20, temperature=0.0),
    ]
    out = Sampler([EOS])(logits, rows)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[1] is None
    for i, k in [(0, 5), (2, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, lp.token_id]).sum())
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == ref[i].topk(k).indices.tolist() or k == 0
        assert [v for _, v in lp.top] == pytest.approx(ref[i].topk(k).values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out.logprobs[3].rank == 1


def test_rejects_mismatched_logits() -> None:
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, VOCAB), [row()])


def sorted_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: sort the whole vocabulary once (stable, so ties keep the lower id),
    keep the top_k, then the smallest most-likely set whose renormalised mass reaches top_p."""
    vocab = x.shape[1]
    vals, order = x.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(vocab)
    k = torch.where(top_k > 0, top_k, vocab)
    drop = pos[None, :] >= k[:, None]
    probs = torch.softmax(vals.masked_fill(drop, -torch.inf), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop |= (before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop = drop.scatter(1, order, drop)
    return x.masked_fill(drop, -torch.inf)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_keeps_the_sorted_reference_set(seed: int) -> None:
    """Without sorting the vocabulary, the same tokens stay: peaked and flat rows (whose
    top_p set is not closed within the first candidates), repeated logits (ties at the
    cut) and every mix of top_k and top_p."""
    g = make_generator(seed)
    vocab = 5000
    x = torch.randn(12, vocab, generator=g) * torch.tensor([8.0, 3.0, 1.0, 0.05] * 3)[:, None]
    x[4:8] = torch.round(x[4:8] * 2) / 2  # many exactly equal logits
    top_k = torch.tensor([0, 0, 0, 0, 0, 5, 100, 0, 2000, 40, 0, 1])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 0.7, 1.0, 0.8, 0.3, 0.99, 0.6, 1.0, 0.5])
    got = top_k_top_p(x, top_k, top_p)
    want = sorted_top_k_top_p(x, top_k, top_p)
    kept, wanted = (~torch.isinf(got)).sum(dim=-1), (~torch.isinf(want)).sum(dim=-1)
    for i in range(len(x)):
        if kept[i] != wanted[i]:  # only where float rounding decides: the mass before the cut is top_p
            probs = torch.softmax(x[i].double(), dim=-1).sort(descending=True).values
            before = float(probs[: min(kept[i], wanted[i])].sum())
            assert abs(kept[i] - wanted[i]) == 1 and before == pytest.approx(float(top_p[i]), abs=1e-5), i
            continue
        assert torch.equal(got[i], want[i]), i  # the same tokens, ties at the cut included
    assert kept[10] == vocab and kept[11] == 1 and kept[5] == 5  # no filter; top_k alone
    assert kept[3] > 64 * 16  # a flat row: its set closed only on the whole vocabulary


def test_inverse_cdf_never_picks_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    picked = inverse_cdf(probs, torch.tensor([0.0, 0.5, 1.0 - 1e-16], dtype=torch.float64))
    assert picked.tolist() == [1, 3, 3]


def test_inverse_cdf_follows_the_distribution_across_blocks() -> None:
    """Mass on both sides of the 1024-token block edges, and in a last, partial block."""
    ids = [3, 1023, 1024, 2500, 4999]
    want = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    probs = torch.zeros(1, 5000)
    probs[0, ids] = want
    u = torch.rand(20000, generator=make_generator(5), dtype=torch.float64)
    picked = inverse_cdf(probs.expand(len(u), -1), u).tolist()
    assert set(picked) <= set(ids)
    assert chi_square([ids.index(t) for t in picked], want) < 18.5  # 4 dof, p = 0.001


@pytest.mark.parametrize("kw", [{"top_p": 0.9}, {"top_k": 5}, {"top_k": 5, "top_p": 0.5, "min_p": 0.1}, {}])
def test_a_row_with_nothing_left_is_reported_not_raised(kw: dict) -> None:
    """Constraints that ban every token (here bad_words) leave a row all -inf; the filters
    must pass it through so the engine can end that request, and its neighbours sample."""
    params = SamplingParams(**kw)
    banned = SamplingRow(params, None, [], [], rules=TokenRules.of(params, [[t] for t in range(VOCAB)]))
    out = Sampler([EOS])(random_logits(2, seed=8), [banned, row(**kw)])
    assert out.no_token == [0]
    assert 0 <= out.token_ids[1] < VOCAB


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_row_that_is_not_a_distribution_is_reported_never_sampled(temperature: float, poison: float) -> None:
    """One NaN or +inf score (an overflow) ruins its row: the inverse CDF used to land in
    the padding past a vocabulary that is not a multiple of 1,024 (32,000 here), and the
    next embedding lookup killed the engine. The row is reported; its neighbour samples."""
    vocab = 32000
    x = random_logits(2, seed=9, vocab=vocab)
    x[0, 123] = poison
    out = Sampler([EOS])(x, [row(temperature=temperature), row(temperature=temperature)])
    assert out.not_finite == [0] and out.no_token == []
    assert all(0 <= t < vocab for t in out.token_ids)


def test_tiny_temperatures_are_greedy_and_extreme_penalties_are_refused() -> None:
    x = random_logits(1, seed=10, vocab=32000)
    for t in (1e-45, 1e-30, 9e-6):
        assert SamplingParams(temperature=t).greedy
        out = Sampler([EOS])(x.clone(), [row(temperature=t)])
        assert out.token_ids == [int(x.argmax())] and not out.not_finite
    assert not SamplingParams(temperature=1e-4).greedy
    for name, value in (("repetition_penalty", 1e-30), ("repetition_penalty", 1e30), ("temperature", 1e300),
                        ("temperature", float("nan"))):
        with pytest.raises(ParamError) as err:
            SamplingParams(**{name: value}).validate()
        assert err.value.param == name


@pytest.mark.parametrize(("name", "value"), [("temperature", "hot"), ("n", True), ("max_tokens", 2.5),
                                             ("stop", [1]), ("logit_bias", {"5": 1.0}), ("structured", "json"),
                                             ("early_stopping", 1), ("seed", "42")])
def test_a_field_of_the_wrong_type_is_refused_naming_it(name, value) -> None:
    with pytest.raises(ParamError) as err:
        SamplingParams(**{name: value}).validate()
    assert err.value.param == name


def test_validate_normalizes_what_callers_pass_and_is_idempotent() -> None:
    p = SamplingParams(temperature=0, stop="x", top_k=-1, stop_token_ids=(1, 2), bad_words=None).validate()
    assert (p.temperature, p.stop, p.top_k, p.stop_token_ids, p.bad_words) == (0.0, ["x"], 0, [1, 2], [])
    assert isinstance(p.temperature, float) and p.validate() == p
