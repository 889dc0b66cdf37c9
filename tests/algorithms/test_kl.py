"""KL estimators against their closed forms and their defining expectation property."""

import math

import pytest
import torch

from verl_balance.algorithms import KLEstimatorError, kl_penalty


def test_estimators_match_closed_forms():
    log_p = torch.tensor([-1.0, -2.0, -0.5])
    log_ref = torch.tensor([-1.5, -1.0, -0.5])
    x = [0.5, -1.0, 0.0]  # log p - log p_ref
    expected = {
        "k1": x,
        "k2": [0.5 * v * v for v in x],
        "abs": [abs(v) for v in x],
        "low_var_kl": [math.exp(-v) + v - 1 for v in x],
    }
    for name, values in expected.items():
        got = kl_penalty(log_probs=log_p, ref_log_probs=log_ref, kl_type=name)
        torch.testing.assert_close(got, torch.tensor(values), msg=name)


@pytest.mark.parametrize("alias,name", [("k3", "low_var_kl"), ("kl", "k1"), ("mse", "k2")])
def test_verl_aliases(alias, name):
    log_p, log_ref = torch.randn(5), torch.randn(5)
    assert torch.equal(
        kl_penalty(log_probs=log_p, ref_log_probs=log_ref, kl_type=alias),
        kl_penalty(log_probs=log_p, ref_log_probs=log_ref, kl_type=name),
    )


@pytest.mark.parametrize("name", ["k1", "low_var_kl"])
def test_unbiased_estimators_have_exact_kl_as_expectation_under_p(name):
    gen = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(torch.randn(12, generator=gen, dtype=torch.float64), -1)
    log_ref = torch.log_softmax(torch.randn(12, generator=gen, dtype=torch.float64), -1)
    exact_kl = (log_p.exp() * (log_p - log_ref)).sum()
    estimate = kl_penalty(log_probs=log_p, ref_log_probs=log_ref, kl_type=name)
    torch.testing.assert_close((log_p.exp() * estimate).sum(), exact_kl)


def test_low_var_kl_is_nonnegative_and_clamped_like_verl():
    log_p = torch.tensor([0.0, 0.0, -100.0, 0.0])
    log_ref = torch.tensor([0.0, -3.0, 0.0, -100.0])
    got = kl_penalty(log_probs=log_p, ref_log_probs=log_ref, kl_type="low_var_kl")
    assert torch.isfinite(got).all() and (got >= 0).all() and (got <= 10).all()
    torch.testing.assert_close(got[:2], torch.tensor([0.0, math.exp(-3) + 3 - 1]))
    assert got[2] == 10 and got[3] == 10  # log-ratio clamped to +-20, then the estimate to 10


def test_unknown_estimator_is_rejected():
    with pytest.raises(KLEstimatorError, match="kl_loss_type='full'"):
        kl_penalty(log_probs=torch.zeros(1), ref_log_probs=torch.zeros(1), kl_type="full")
