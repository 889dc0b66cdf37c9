"""sum_pi_squared (verl's ``actor.calculate_sum_pi_squared``): the sum over the vocabulary of p(v)^2 of each
position's distribution at the pass's temperature, computed by the chunked output head in the log-prob
pass (``output_head.head_token_stats``, ``TrainEngine.compute_log_prob(with_sum_pi_squared=True)``).

References: verl's ``calculate_sum_pi_squared_from_logits`` on the same logits / temperature (float64,
rtol 1e-6), and a brute-force softmax of a tiny model's full logits per sequence against the engine's
column on sp=2 with the chunked and the unchunked head. Negative control: the brute force at another
temperature differs from the engine's column.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.batch_keys import ENTROPY_KEY, LOG_PROBS_KEY, SUM_PI_SQUARED_KEY
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.models import LlamaForCausalLM
from verl_balance.models.output_head import LogitTransform, head_token_log_probs, head_token_stats
from verl_balance.parity import ParitySettings, make_global_batch

SETTINGS = ParitySettings()
TEMPERATURE = 0.7
CHUNK_SIZES = (0, 3)  # 0: the unchunked head; 3 divides no micro-batch


def _head_inputs(seed: int, tokens: int = 13, hidden: int = 8, vocab: int = 29):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    per_token_t = 0.5 + torch.rand(tokens, generator=gen, dtype=torch.float64)
    return h, w, targets, per_token_t


@pytest.mark.parametrize("chunk_size", [0, 1, 4, 64])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)], ids=["id", "cap"])
@pytest.mark.parametrize("per_token_temperature", [False, True])
def test_head_sum_pi_squared_equals_verls_on_random_logits(chunk_size, transform, per_token_temperature):
    torch_functional = pytest.importorskip("verl.utils.torch_functional", reason=VERL_SKIP_REASON)
    h, w, targets, per_token_t = _head_inputs(seed=chunk_size)
    temperature = per_token_t if per_token_temperature else TEMPERATURE
    log_probs, entropy, sum_pi_squared = head_token_stats(
        h, w, targets, transform=transform, temperature=temperature, chunk_size=chunk_size
    )
    logits = transform.apply(h @ w.T)
    scaled = logits / (per_token_t[:, None] if per_token_temperature else TEMPERATURE)
    want = torch_functional.calculate_sum_pi_squared_from_logits(scaled)
    torch.testing.assert_close(sum_pi_squared, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(sum_pi_squared, torch.softmax(scaled, -1).square().sum(-1), rtol=1e-6, atol=0)
    # the log-probs and entropy are the training head's, chunk for chunk
    ref_lp, ref_ent = head_token_log_probs(
        h, w, targets, transform=transform, temperature=temperature, with_entropy=True, chunk_size=chunk_size
    )
    torch.testing.assert_close(log_probs, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-12, atol=1e-12)
    # bounds: 1/V <= sum p^2 <= 1 and sum p^2 >= p(target)^2 (the test would catch a wrong reduction)
    assert bool((sum_pi_squared <= 1).all()) and bool((sum_pi_squared >= 1 / w.shape[0] - 1e-12).all())
    assert bool((sum_pi_squared >= log_probs.exp().square() - 1e-12).all())


def _engine_columns(rank: int) -> dict:
    from verl_balance.distributed.layout import ParallelLayout
    from verl_balance.engine.train_engine import TrainEngine

    layout = ParallelLayout(dp=1, sp=2, device_type="cpu")
    batch = make_global_batch(SETTINGS)
    micro_batches = [{k: v[i : i + 3] for k, v in batch.items()} for i in range(0, len(batch["input_ids"]), 3)]
    out = {}
    for chunk in CHUNK_SIZES:
        config = dataclasses.replace(SETTINGS.engine_config(agg_mode="token-mean"), logits_chunk_size=chunk)
        engine = TrainEngine(model_config=SETTINGS.model, engine_config=config, layout=layout)
        columns = engine.compute_log_prob(
            micro_batches, with_entropy=True, with_sum_pi_squared=True, temperature=TEMPERATURE
        )
        plain = engine.compute_log_prob(micro_batches, temperature=TEMPERATURE)
        out[chunk] = {
            key: torch.cat([c[key] for c in columns]) for key in (LOG_PROBS_KEY, ENTROPY_KEY, SUM_PI_SQUARED_KEY)
        }
        out[chunk]["plain_log_probs"] = torch.cat([c[LOG_PROBS_KEY] for c in plain])
        out[chunk]["plain_keys"] = sorted(plain[0])
    return out


def _brute_force(batch, temperature: float) -> torch.Tensor:
    """(B, L): softmax(full logits / temperature)^2 summed over the vocabulary, one forward per sequence,
    aligned like log_probs (position t: the distribution predicting token t; 0 at t = 0 and padding)."""
    torch.manual_seed(SETTINGS.seed)  # TrainEngine builds its model from the same seed
    model = LlamaForCausalLM(SETTINGS.model, attn_impl="sdpa_masked")
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i in range(len(out)):
            length = int(batch["attention_mask"][i].sum())
            ids = batch["input_ids"][i, :length]
            logits = model(
                input_ids=ids,
                position_ids=torch.arange(length),
                cu_seqlens=torch.tensor([0, length]),
                max_seqlen=length,
            ).double()
            out[i, 1:length] = torch.softmax(logits[:-1] / temperature, -1).square().sum(-1).float()
    return out


@pytest.mark.slow
def test_engine_sum_pi_squared_equals_a_brute_force_softmax_on_sp2_chunked_and_not():
    batch = make_global_batch(SETTINGS)
    want = _brute_force(batch, TEMPERATURE)
    mask = batch["attention_mask"].clone()
    mask[:, 0] = 0
    other = _brute_force(batch, 1.0)  # negative control: the column at the wrong temperature
    for rank_result in run_on_ranks(_engine_columns, world=2):
        for chunk in CHUNK_SIZES:
            got = rank_result[chunk]
            assert got["plain_keys"] == [LOG_PROBS_KEY]  # the column only when asked for
            torch.testing.assert_close(got[SUM_PI_SQUARED_KEY] * mask, want * mask, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(got[LOG_PROBS_KEY], got["plain_log_probs"], rtol=1e-6, atol=1e-6)
            with pytest.raises(AssertionError):
                torch.testing.assert_close(got[SUM_PI_SQUARED_KEY] * mask, other * mask, rtol=1e-5, atol=1e-9)
