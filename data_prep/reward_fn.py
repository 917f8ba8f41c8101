"""Custom reward function for verl 0.9.1: every math set -> ``math_dapo``; GPQA -> multiple choice.

verl groups validation metrics by ``data_source`` (``val-core/<data_source>/acc/mean@8``), so each
evaluation set carries its own name (``math500``, ``aime2024``, ...). verl's built-in router would
score most of those names with the wrong scorer or not at all, so this function routes them:

* :data:`MATH_DATA_SOURCES` (the training set ``math_dapo`` and the math evaluation sets) ->
  ``verl.utils.reward_score.math_dapo.compute_score`` (score +1/-1, ``acc``, ``pred``);
* :data:`ARITH_DATA_SOURCES` (the tiny LM's ``arith_<skill>`` sets, ``Answer: N`` responses) ->
  ``math_dapo.compute_score`` too;
* :data:`GPQA_DATA_SOURCES` -> :func:`gpqa_compute_score` (same return keys);
* anything else -> ``verl.utils.reward_score.default_compute_score`` unchanged.

Wire it with the Hydra overrides (the v1 trainer reads only ``reward.*``)::

    reward.custom_reward_function.path=pkg://data_prep.reward_fn   # or an absolute path to this file
    reward.custom_reward_function.name=compute_score

With the ``pkg://`` form (the launch scripts') verl imports it as the package module
``data_prep.reward_fn`` (``importlib.import_module`` in ``verl.utils.import_utils.load_module``)
inside the reward workers, which Ray spreads over every node: ``data_prep`` must be importable
there. The recipe's entry point ships it (with ``recipe`` and ``verl_ext``) to all workers through
Ray's runtime_env ``py_modules`` (recipe/gdro/startup/cluster.py; docs/cluster.md). A file path instead
is loaded with ``spec_from_file_location`` and must exist at that path on every node. Either way
the module imports nothing else from this repository: only the standard library and verl.
"""

from __future__ import annotations

import re
from typing import Any

from verl.utils.reward_score import default_compute_score, math_dapo

# Names written by data_prep (dapo.py, eval_sets.py). Keep in sync with eval_sets.EVAL_SETS.
MATH_DATA_SOURCES = frozenset({"math_dapo", "math500", "aime2024", "aime2025", "amc23", "minerva", "olympiadbench"})
GPQA_DATA_SOURCES = frozenset({"gpqa_diamond"})
# The tiny LM's arithmetic skills (arith.py writes "arith_<skill>"; keep in sync with arith.SKILLS).
# Responses end in "Answer: N", which math_dapo's Minerva path extracts.
ARITH_DATA_SOURCES = frozenset(
    f"arith_{s}" for s in ("add2", "sub2", "add3", "add4", "add5", "add6", "mul1x2", "mul1x3", "mul2x2")
)

CHOICE_LETTERS = "ABCD"
INVALID = "[INVALID]"  # same marker math_dapo uses when nothing could be extracted

# Like math_dapo: only the tail of the response is read (the answer comes last).
_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# A choice letter standing alone: "C", "(C)", "C)", "C.", "C: text", "\text{C}", "**C**".
_LETTER = re.compile(r"^[\s(\[{*$]*([A-D])(?![A-Za-z0-9])")
_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    boxed = math_dapo.last_boxed_only_string(text)
    if boxed is None:
        return None
    return boxed[len("\\boxed{") : -1]


def extract_choice(text: str) -> str | None:
    """The choice letter A-D a piece of answer text starts with, or None."""
    text = _LATEX_WRAPPERS.sub(r"\1", text).strip()
    match = _LETTER.match(text)
    return match.group(1) if match else None


def gpqa_compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """Score a multiple-choice response against the correct letter.

    Reads the last 300 characters like math_dapo: an ``Answer: X`` line first, then the last
    ``\\boxed{X}``. Returns ``{"score": 1.0 or -1.0, "acc": bool, "pred": letter or "[INVALID]"}``.
    """
    tail = solution_str[-_TAIL_CHARS:]
    pred = None
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        pred = extract_choice(lines[-1])
    if pred is None:
        boxed = _last_boxed(tail)
        if boxed is not None:
            pred = extract_choice(boxed)
    correct = pred is not None and pred == str(ground_truth).strip().upper()
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred if pred is not None else INVALID}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict[str, Any] | float:
    """verl custom reward entry point.

    verl 0.9.1's reward managers call it with keyword arguments ``data_source``, ``solution_str``,
    ``ground_truth``, ``extra_info`` (plus ``reward_router_address`` / ``reward_model_tokenizer``
    when a reward model router runs, and anything under ``reward.custom_reward_function.reward_kwargs``),
    hence ``**kwargs``.
    """
    if data_source in MATH_DATA_SOURCES or data_source in ARITH_DATA_SOURCES:
        return math_dapo.compute_score(solution_str, ground_truth)
    if data_source in GPQA_DATA_SOURCES:
        return gpqa_compute_score(solution_str, ground_truth)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
