"""The exact metric (recipe/gdro/lab/tinylm/exact.py): teacher-forced probability of the canonical answer."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from data_prep import arith
from recipe.gdro.lab.tinylm import exact, policy, tasks
from recipe.gdro.lab.tinylm.model import BASE_MODEL_DIR, build_tokenizer, load_model, load_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def base():
    """The shipped base: its probabilities span 0..1 on these prompts (solved, frontier, dead)."""
    return load_model(BASE_MODEL_DIR)


PROMPTS = ["12+34=", "50-17=", "123+456=", "4567+5678=", "7*89=", "12+345=", "45*67="]
ANSWERS = ["46", "33", "579", "10245", "623", "357", "3015"]


def _stepwise(model, tok, content: str, answer: str, temperature: float) -> float:
    """A separate path: no padding, one prefix at a time, the next-token softmax read off the last logit."""
    seq = tasks.prompt_ids(tok, content)
    target = [tok.get_vocab()[c] for c in arith.response_text(answer)] + [tok.eos_token_id]
    prob = 1.0
    for token in target:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double()
        if temperature == 0:
            prob *= float(int(logits.argmax()) == token)
        else:
            prob *= float(torch.softmax(logits / temperature, -1)[token])
        seq = seq + [token]
    return prob


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7, 0.0])
def test_equals_the_product_of_step_wise_probabilities(tok, base, temperature):
    got = exact.answer_probability(base, tok, PROMPTS, ANSWERS, temperature=temperature, batch_size=2)
    want = [_stepwise(base, tok, p, a, temperature) for p, a in zip(PROMPTS, ANSWERS, strict=True)]
    assert got.shape == (len(PROMPTS),)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-12)
    if temperature:
        assert np.all((got > 0) & (got < 1))
        assert got.max() > 0.5 and got.min() < 0.2  # the prompts span the range
    else:
        assert set(got.tolist()) == {0.0, 1.0}


def test_temperature_scales_the_logits_and_batching_does_not_matter(tok, base):
    p1 = exact.answer_probability(base, tok, PROMPTS, ANSWERS, temperature=1.0, batch_size=256)
    p1b = exact.answer_probability(base, tok, PROMPTS, ANSWERS, temperature=1.0, batch_size=1)
    np.testing.assert_allclose(p1, p1b, rtol=1e-4)  # float32: padding changes the summation order
    # T = 2 on the model is T = 1 on a model whose logits are halved (tied head: halve the final norm).
    half = copy.deepcopy(base)
    with torch.no_grad():
        half.model.norm.weight.mul_(0.5)
    p2 = exact.answer_probability(base, tok, PROMPTS, ANSWERS, temperature=2.0)
    np.testing.assert_allclose(p2, exact.answer_probability(half.eval(), tok, PROMPTS, ANSWERS), rtol=1e-4)
    assert np.abs(p1 - p2).max() > 0.05


def test_canonical_response_is_the_sft_target(tok):
    ids = exact.canonical_response_ids(tok, "46")
    assert tok.decode(ids) == "Answer: 46<|end|>"
    assert ids[-1] == tok.eos_token_id and len(ids) == len("Answer: 46") + 1
    with pytest.raises(ValueError, match="outside the tokenizer"):
        exact.canonical_response_ids(tok, "4.6")


def test_bad_arguments(tok, base):
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        exact.answer_probability(base, tok, ["1+1=", "2+2="], ["2"])
    with pytest.raises(ValueError, match="temperature"):
        exact.answer_probability(base, tok, ["1+1="], ["2"], temperature=-1)


def test_equals_the_monte_carlo_frequency_of_exact_samples(base):
    """On the shipped base: the frequency of sampling exactly the canonical response matches P_T."""
    model, tok = base, load_tokenizer(BASE_MODEL_DIR)
    records = tasks.val_records(300, 0)
    # Prompts spread over the skills, so probabilities span the range (dead, frontier, solved).
    picks = []
    for skill in arith.SKILLS:
        picks += [r for r in records if r["extra_info"]["skill"] == skill.name][:2]
    prompts = [r["prompt"][0]["content"] for r in picks]
    answers = [r["reward_model"]["ground_truth"] for r in picks]
    temperature, draws = 1.2, 400
    p = exact.answer_probability(model, tok, prompts, answers, temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    ids = [tasks.prompt_ids(tok, c) for c in prompts]
    out = policy.sample(
        model,
        [x for x in ids for _ in range(draws)],
        max_new_tokens=tasks.MAX_RESPONSE_TOKENS,
        temperature=temperature,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=generator,
    )
    freq = np.zeros(len(prompts))
    for k, a in enumerate(answers):
        target = exact.canonical_response_ids(tok, a)
        freq[k] = np.mean([r == target for r, _ in out[k * draws : (k + 1) * draws]])
    se = np.sqrt(np.maximum(p * (1 - p), 1e-4) / draws)
    z = (freq - p) / se
    assert np.all(np.abs(z) < 4.0), (p, freq)
    # And the pooled mean over prompts, within its binomial error.
    pooled_se = math.sqrt(float(np.sum(p * (1 - p))) / draws) / len(p)
    assert abs(freq.mean() - p.mean()) < 4 * pooled_se + 1e-3
    assert p.max() - p.min() > 0.3  # the check spans the range, not only p ~ 1


def test_exact_by_skill_and_mean(tok, base):
    records = tasks.val_records(60, 0)
    table = exact.exact_by_skill(base, tok, records, temperature=1.0)
    assert table["all"]["n"] == len(records)
    assert sum(v["n"] for k, v in table.items() if k != "all") == len(records)
    weighted = sum(v["n"] * v["exact"] for k, v in table.items() if k != "all") / len(records)
    assert table["all"]["exact"] == pytest.approx(weighted, rel=1e-9)
    assert exact.mean_exact(base, tok, records) == pytest.approx(table["all"]["exact"], rel=1e-9)


@pytest.mark.parametrize("temps", ["0.3,x", "-1", ""])
def test_cli_bad_temperatures_exit_2_with_one_line(capsys, temps):
    assert exact.main(["--temperatures", temps]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --temperatures") and err.count("\n") == 1


def test_gradsignal_cli_bad_arguments_exit_2(capsys):
    from recipe.gdro.lab.tinylm import gradsignal

    assert gradsignal.main(["--prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prompts") and err.count("\n") == 1
