"""A reward for CPU-backend wiring tests on an untrained tiny LM (which never writes an answer).

The ground truth picks the rule: ``gt % 3 == 0`` always correct, ``gt % 3 == 1`` never, otherwise
correct when the decoded response has an even number of characters -- a property of what the model
really sampled, which varies from response to response and which RL can learn. So prompts differ in
difficulty and in outcome variance (0 for the first two kinds), which gives the difficulty binner
and both adversaries something to act on.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    kind = int(ground_truth) % 3
    acc = True if kind == 0 else False if kind == 1 else len(solution_str) % 2 == 0
    return {"score": 1.0 if acc else -1.0, "acc": acc}
