"""RAS sampler: upstream parity on the goldens (ras.npz) and the exactness of ras_log_probs."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from async_cosyvoice.models.dims import EOS_TOKEN, STOP_TOKENS, RASParams
from async_cosyvoice.sampling import (_sorted_nucleus, nucleus, ras_log_probs, ras_sample, ras_sample_batch,
                                      suppress_batch)

pytestmark = pytest.mark.usefixtures("_one_thread")

CASES = ["llm_step0_no_history", "llm_step0_argmax_in_history", "peaked_no_history", "peaked_top_in_history",
         "peaked_top_outside_window", "flat_topk_limited"]
SEEDS = [0, 1, 2, 1234]
P_MIN = 1e-3  # chi-square acceptance, fixed seeds so the outcome is deterministic


@pytest.fixture(scope="module")
def ras(golden_dir):
    return np.load(golden_dir / "ras.npz")


def _case(ras, case):
    return torch.from_numpy(ras[f"{case}/weighted_scores"]), ras[f"{case}/decoded_tokens"].tolist()


def _history(decoded: list[int], width: int = 16) -> torch.Tensor:
    row = [-1] * max(0, width - len(decoded)) + decoded[-width:]
    return torch.tensor([row])


@pytest.mark.parametrize("case", CASES)
def test_nucleus_matches_upstream_exactly(ras, case):
    scores, _ = _case(ras, case)
    ids, probs = nucleus(scores, 0.8, 25)
    np.testing.assert_array_equal(ids.numpy(), ras[f"{case}/nucleus_ids"])
    np.testing.assert_array_equal(probs.numpy(), ras[f"{case}/nucleus_probs"])


@pytest.mark.parametrize("case", CASES)
def test_seeded_results_match_upstream(ras, case):
    scores, decoded = _case(ras, case)
    for seed in SEEDS:
        torch.manual_seed(seed)
        assert ras_sample(scores.clone(), decoded) == int(ras[f"{case}/seed{seed}/result"][0]), seed
        g = torch.Generator().manual_seed(seed)
        assert ras_sample(scores, decoded, generator=g) == int(ras[f"{case}/seed{seed}/result"][0]), seed


def test_peaked_rules(ras):
    for case, expect_123 in [("peaked_no_history", True), ("peaked_top_outside_window", True),
                             ("peaked_top_in_history", False)]:
        scores, decoded = _case(ras, case)
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            assert (ras_sample(scores, decoded, generator=g) == 123) == expect_123
            pick = ras_sample_batch(scores[None], _history(decoded), generator=g)
            assert (int(pick) == 123) == expect_123
        lp = ras_log_probs(scores[None], _history(decoded))[0]
        assert (lp[123].exp().item() == 1.0) == expect_123
        if not expect_123:
            assert lp[123].item() == -float("inf")


def test_greedy_top_k_1_never_falls_back(ras):
    scores, _ = _case(ras, "peaked_top_in_history")
    greedy = RASParams(top_k=1)
    decoded = [123] * 10
    assert ras_sample(scores, decoded, greedy) == 123
    assert int(ras_sample_batch(scores[None], _history(decoded), top_k=1)) == 123
    lp = ras_log_probs(scores[None], _history(decoded), top_k=1)[0]
    assert lp[123].item() == 0.0 and torch.isinf(lp).sum() == len(lp) - 1


def _crafted():
    """Rows where the repetition fallback carries real mass, with per-row parameters."""
    p = torch.tensor([0.45, 0.2, 0.12, 0.08, 0.05, 0.04, 0.03, 0.02, 0.007, 0.003], dtype=torch.float64)
    scores = p.log().float().expand(4, -1).clone()
    scores[3, 5] = -float("inf")  # an EOS-style masked entry
    history = torch.tensor([[-1, -1, -1, -1, -1, -1, -1, 0, 2, 9],  # 0 and 2 repeated (threshold 1)
                            [-1, -1, -1, -1, -1, -1, -1, -1, -1, -1],  # plain nucleus
                            [0, 1, 1, 1, 1, 1, 3, 1, 0, 1],  # win 5, tau .4: 1 (3x in window) repeated, 0 (1x) not
                            [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]])  # 0 dominant and repeated, 1 at the window edge
    params = dict(top_p=torch.tensor([0.8, 0.8, 0.95, 0.5], dtype=torch.float64),
                  top_k=torch.tensor([25, 25, 3, 25]),
                  win_size=torch.tensor([10, 10, 5, 2]),
                  tau_r=torch.tensor([0.1, 0.1, 0.4, 0.5], dtype=torch.float64))
    return scores, history, params


def _chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "drew an id of probability 0"
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big & (probs > 0)).any():  # pool the rare ids into one bin
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    exp_b = np.array(exp_b) * (sum(obs_b) / sum(exp_b))
    return chisquare(obs_b, exp_b).pvalue


def test_ras_log_probs_normalised_and_analytic():
    scores, history, params = _crafted()
    prob = ras_log_probs(scores, history, **params).exp()
    np.testing.assert_allclose(prob.sum(-1).numpy(), 1.0, atol=1e-12)
    p = torch.tensor([0.45, 0.2, 0.12, 0.08, 0.05, 0.04, 0.03, 0.02, 0.007, 0.003], dtype=torch.float64)
    # row 0: nucleus {0,1,2,3} (cum before 4th = 0.77 < 0.8), 0 and 2 repeated
    nuc = p[:4] / p[:4].sum()
    expect = p * (nuc[0] / (1 - p[0]) + nuc[2] / (1 - p[2]))
    expect[0] -= p[0] * nuc[0] / (1 - p[0])
    expect[2] -= p[2] * nuc[2] / (1 - p[2])
    expect[[1, 3]] += nuc[[1, 3]]
    np.testing.assert_allclose(prob[0].numpy(), expect.numpy(), atol=1e-7)  # scores are float32 logs of p
    # row 1: the plain nucleus
    np.testing.assert_allclose(prob[1, :4].numpy(), nuc.numpy(), atol=1e-7)
    assert prob[1, 4:].sum() == 0
    # row 3: id 5 masked gets nothing, whatever the fallback
    assert prob[3, 5] == 0


def test_batch_sampler_matches_log_probs_chi2():
    scores, history, params = _crafted()
    n = 50_000
    B = scores.shape[0]
    rep = lambda t: t.repeat_interleave(n, 0)  # noqa: E731
    g = torch.Generator().manual_seed(7)
    picks = ras_sample_batch(rep(scores), rep(history), generator=g, **{k: rep(v) for k, v in params.items()})
    probs = ras_log_probs(scores, history, **params).exp().numpy()
    for b in range(B):
        counts = np.bincount(picks[b * n:(b + 1) * n].numpy(), minlength=scores.shape[1])
        assert _chi2_p(counts, probs[b]) > P_MIN, b


@pytest.mark.slow
def test_reference_sampler_matches_log_probs_chi2():
    scores, history, params = _crafted()
    probs = ras_log_probs(scores, history, **params).exp().numpy()
    g = torch.Generator().manual_seed(11)
    n = 3000
    for b in range(scores.shape[0]):
        ras = RASParams(top_p=float(params["top_p"][b]), top_k=int(params["top_k"][b]),
                        win_size=int(params["win_size"][b]), tau_r=float(params["tau_r"][b]))
        decoded = [t for t in history[b].tolist() if t >= 0]
        counts = np.bincount([ras_sample(scores[b], decoded, ras, g) for _ in range(n)], minlength=scores.shape[1])
        assert _chi2_p(counts, probs[b]) > P_MIN, b


def test_batch_rows_are_independent_of_batch_composition():
    scores, history, params = _crafted()
    u = torch.rand(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    together = ras_sample_batch(scores, history, uniforms=u, **params)
    for b in range(4):
        alone = ras_sample_batch(scores[b:b + 1], history[b:b + 1], uniforms=u[b:b + 1],
                                 **{k: v[b:b + 1] for k, v in params.items()})
        assert int(alone) == int(together[b])


def test_bounded_top_k_path_equals_full_sort(ras):
    """max_top_k swaps the stable sort for a top-k on a tie-breaking key: same draws, ties included."""
    rows = [torch.from_numpy(ras[f"{c}/weighted_scores"]) for c in CASES]
    tied = torch.zeros(6564)
    tied[[7, 3, 4000, 12]] = 2.0  # exact ties among the top: stable order is 3, 7, 12, 4000
    rows.append(tied)
    scores = torch.stack(rows).repeat(50, 1)
    B = scores.shape[0]
    history = torch.randint(0, 6564, (B, 10), generator=torch.Generator().manual_seed(0))
    history[:, -3:] = torch.tensor([3, 1624, 123])
    u = torch.rand(B, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    top_k = torch.randint(1, 30, (B,), generator=torch.Generator().manual_seed(2))
    full = ras_sample_batch(scores, history, top_k=top_k, uniforms=u)
    bounded = ras_sample_batch(scores, history, top_k=top_k, uniforms=u, max_top_k=30)
    assert torch.equal(full, bounded)
    _, ids, _ = _sorted_nucleus(tied[None], 0.99, 25, max_top_k=8)
    assert ids[0, :4].tolist() == [3, 7, 12, 4000]


def test_golden_scores_log_probs_sum_to_one(ras):
    for case in CASES:
        scores, decoded = _case(ras, case)
        lp = ras_log_probs(scores[None], _history(decoded))
        assert abs(lp.exp().sum().item() - 1.0) < 1e-12


def test_stop_rules():
    batch = torch.zeros(4, 6564)
    suppress_batch(batch, torch.tensor([0, 5, 5, 3]), torch.tensor([3, 3, 0, 3]),
                   torch.tensor([False, False, True, False]))
    assert torch.isfinite(batch[3]).all()  # min_tokens out: EOS allowed
    assert torch.isinf(batch[0, EOS_TOKEN]) and torch.isfinite(batch[0, EOS_TOKEN + 1:]).all()
    assert torch.isfinite(batch[1]).all()
    assert torch.isinf(batch[2, list(STOP_TOKENS)]).all()
    assert torch.isfinite(batch[:, :EOS_TOKEN]).all()
