"""tools/fuzz/coverage.py: axis values and pairs of them exercised, against the pairs the rules allow."""
from tools.fuzz.coverage import Coverage, allowed_pairs, most_covering, pairs_of
from tools.fuzz.sampler import AXES, draw, other_families


def test_pairs_of_one_layout():
    pairs = pairs_of(draw(0).axes)
    assert len(pairs) == len(AXES) * (len(AXES) - 1) // 2
    assert (("family", draw(0).axes["family"]), ("tp", draw(0).axes["tp"])) in pairs


def test_coverage_counts_both_layouts_and_lists_what_is_missing():
    cov = Coverage()
    for s in range(6):
        cov.add(draw(s))
    assert cov.layouts == 12 and sum(cov.values["tp"].values()) == 12
    allowed = allowed_pairs(samples=60, seed=1)
    text = cov.describe(allowed)
    covered = len(allowed & set(cov.pairs))
    assert f"pairs of axis values covered: {covered} of {len(allowed)} allowed" in text
    assert "not covered:" in text and covered < len(allowed)
    assert "fp8_recipe" in text and any(v[0] == "fp8" and v[1] != "off" for pair in allowed for v in pair)


def test_allowed_pairs_hold_no_pair_the_rules_refuse():
    allowed = allowed_pairs(samples=150, seed=2)
    assert (("tp", 1), ("sp", True)) not in allowed                 # sequence parallel needs tp >= 2
    assert (("zero", 0), ("offload_optimizer", "cpu")) not in allowed
    assert (("cp", 2), ("qwz", True)) not in allowed                 # ZeRO++ with cp: refused
    assert (("tp", 2), ("sp", True)) in allowed and (("zero", 3), ("keep_gathered", True)) in allowed
    assert (("cp", 2), ("cp_comm", "a2a")) in allowed and (("zero", 3), ("offload_params", "nvme")) in allowed
    assert {v for pair in allowed for name, v in pair if name == "family"} == {"gpt", "llama", *other_families()}


def test_most_covering_picks_the_candidate_adding_the_most_new_pairs():
    cov = Coverage()
    cov.add(draw(0))
    new = {s: len((pairs_of(draw(s).axes) | pairs_of(draw(s).resume_axes)) - cov.pairs.keys()) for s in range(1, 7)}
    chosen = most_covering(range(1, 7), cov)
    assert new[chosen.seed] == max(new.values())
    assert chosen.seed == min(s for s, n in new.items() if n == max(new.values()))   # the first on a tie
    assert chosen.axes == draw(chosen.seed).axes                    # reruns alone from its seed
