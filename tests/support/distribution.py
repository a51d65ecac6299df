"""The exact distribution test shared by solo (test_exact_sampling) and cohort decoding.

The joint distribution of a tiny model's first N_TOKENS generated tokens is enumerated
exactly; sampled outputs are compared against it with a Pearson chi-square test.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mtplxd.engine.decoding.sampling import probabilities

N_TOKENS = 3
EOS = "eos"


def exact_joint(model, prompt, params):
    """{token tuple: probability} of the first N_TOKENS tokens (paths ending at EOS kept short).

    Level by level: all live prefixes of one length go through one batched, uncached forward.
    """
    eos_ids = set(model.tokenizer.eos_token_ids)
    joint = {}
    live = {(): 1.0}
    for _ in range(N_TOKENS):
        prefixes = list(live)
        batch = mx.array([prompt + list(prefix) for prefix in prefixes])
        p = probabilities(model.model(batch)[:, -1], params, None, None)
        p = p.tolist()
        grown = {}
        for prefix, row in zip(prefixes, p):
            for token, pt in enumerate(row):
                if pt <= 0:
                    continue
                prob = live[prefix] * pt
                if token in eos_ids:
                    joint[prefix + (EOS,)] = joint.get(prefix + (EOS,), 0.0) + prob
                else:
                    grown[prefix + (token,)] = prob
        live = grown
    joint.update(live)
    return joint


def chi_square_p_value(joint, counts, n):
    """Pearson chi-square over cells with expected count >= 5 (the rest merged into one)."""
    stat, cells, rest_expected, rest_observed = 0.0, 0, 0.0, 0
    for key, prob in joint.items():
        expected = prob * n
        if expected >= 5:
            stat += (counts.get(key, 0) - expected) ** 2 / expected
            cells += 1
        else:
            rest_expected += expected
            rest_observed += counts.get(key, 0)
    rest_observed += sum(c for k, c in counts.items() if k not in joint)  # impossible outcomes
    if rest_expected > 0:
        stat += (rest_observed - rest_expected) ** 2 / max(rest_expected, 1e-9)
        cells += 1
    elif rest_observed:
        return 0.0
    dof = cells - 1
    # Wilson-Hilferty: the cube root of chi2/dof is close to normal.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
