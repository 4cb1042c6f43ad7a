"""benchmarks.evidence.partition_skew: the label balance and the rank correlation on hand-computed
cases, and the label counts are exactly the rows each client trains on (disjoint, covering
the pool, seeded), joined with a summary.json's per-seed test scores."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.evidence import partition_skew as skew
from florg_tools.synthetic import make_sentiment_task


def test_label_balance_hand_cases():
    assert skew.label_balance([[5, 5], [3, 3]]) == pytest.approx(1.0)  # every client 50/50
    assert skew.label_balance([[10, 0], [0, 4]]) == pytest.approx(0.0)  # one label each
    # 3 labels: a client of 4 with counts 2/1/1 (H = 1.5 ln 2) and one of 4 with 4/0/0 (H = 0)
    expected = 0.5 * (1.5 * math.log(2)) / math.log(3)
    assert skew.label_balance([[2, 1, 1], [4, 0, 0]]) == pytest.approx(expected)
    with pytest.raises(ValueError):
        skew.label_balance([[3], [2]])


def test_spearman_hand_cases():
    assert skew.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert skew.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x = 1,2,3 ; y = 2,1,3: d = -1,1,0 -> 1 - 6*2/(3*8) = 0.5
    assert skew.spearman([0.1, 0.2, 0.3], [5.0, 4.0, 6.0]) == pytest.approx(0.5)
    # ties take the mean rank: y ranks 1.5,1.5,3 -> Pearson of (1,2,3),(1.5,1.5,3)
    assert skew.spearman([1, 2, 3], [7, 7, 9]) == pytest.approx(math.sqrt(3) / 2)
    assert skew.spearman([1, 2, 3], [5, 5, 5]) is None


@pytest.fixture(scope="module")
def skew_grid(tmp_path_factory, tiny_bert_dir):
    base = tmp_path_factory.mktemp("skew")
    task = make_sentiment_task(base / "task", n_train=90, n_eval=20)
    grid = base / "skew.yaml"
    grid.write_text(f"""
name: skew
simulation: {{num-supernodes: 3, num-cpus-per-client: 1}}
base:
  model: {tiny_bert_dir}
  task: local
  data-path: {task}
  text-fields: sentence
  partitioner: dirichlet
  dirichlet-alpha: 0.3
tuning: {{key: learning-rate, values: [0.001, 0.002], seed: 0, per: [method]}}
grid:
  method: [florg, fedit]
  seed: [0, 1]
""")
    return grid


def test_counts_are_each_clients_training_rows(skew_grid, tmp_path, capsys):
    grid = skew.load_grid(skew_grid)
    settings = skew.seed_settings(grid)  # tuning choices pending: read from the axes
    assert sorted(settings) == [0, 1]
    per_seed = {seed: skew.client_label_counts(o, 3) for seed, o in settings.items()}
    for counts in per_seed.values():
        assert len(counts) == 3 and all(len(c) == 2 for c in counts)
        assert sum(map(sum, counts)) == 90  # the partitions cover the pool, disjointly
    assert per_seed[0] != per_seed[1]  # the seed sets the Dirichlet draw
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"tasks": {"local": {"methods": {
        "florg": {"seeds": [0, 1], "test_final": [0.6, 0.7]},
        "fedit": {"seeds": [1], "test_final": [0.8]},
    }}}}))  # fmt: skip
    out = tmp_path / "skew.json"
    assert skew.main(["--grid", str(skew_grid), "--summary", str(summary), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in printed.splitlines()[2:4]}
    assert lines["0"][2:4] == ["0.600", "-"] and lines["1"][2:4] == ["0.700", "0.800"]
    written = json.loads(out.read_text())
    assert [row["clients"] for row in written["seeds"]] == [per_seed[0], per_seed[1]]
    assert written["seeds"][0]["balance"] == pytest.approx(skew.label_balance(per_seed[0]))
    assert written["spearman"] == {}  # two seeds: too few for a correlation


def test_another_rho_repartitions_the_same_pool(skew_grid, tmp_path, capsys):
    out = tmp_path / "rho.json"
    assert skew.main(["--grid", str(skew_grid), "--json", str(out)]) == 0
    harsh = json.loads(out.read_text())["seeds"]
    args = ["--grid", str(skew_grid), "--dirichlet-alpha", "100", "--json", str(out)]
    assert skew.main(args) == 0
    assert "Dirichlet rho = 100.0" in capsys.readouterr().out
    mild = json.loads(out.read_text())["seeds"]
    for before, after in zip(harsh, mild, strict=True):
        assert sum(map(sum, after["clients"])) == sum(map(sum, before["clients"])) == 90
        assert after["balance"] > before["balance"]  # rho 100 against the grid's 0.3
    iid = tmp_path / "iid.yaml"
    iid.write_text(skew_grid.read_text().replace("partitioner: dirichlet", "partitioner: iid"))
    assert skew.main(["--grid", str(iid), "--dirichlet-alpha", "2"]) == 2
    assert "does not partition by Dirichlet draws" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert skew.main(["--grid", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        skew.main(["--grid", "evidence", "--summary", str(tmp_path / "missing.json")])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        skew.main(["--grid", "evidence", "--dirichlet-alpha", "0"])
    assert "must be > 0" in capsys.readouterr().err
