"""florg_lab.cross_device_sizing: T, C and z for the cross-device private grid
from its non-private pilot's rows."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
from scipy.stats import binomtest

from florg_lab.cross_device_sizing import (
    ScoredRound,
    first_round_above,
    load_pilot,
    main,
    round_up,
    wilson_interval,
)
from florg_lab.grid import GRIDS_DIR, load_grid
from flower_app.privacy.accounting import epsilon_for, noise_multiplier_for


def _run(
    root: Path,
    name: str,
    method: str,
    tests: dict[int, float],
    norms: list[float],
    wall: float = 100.0,
    rate: float = 0.05,
) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"method": method}))
    (run / "summary.json").write_text(json.dumps({"status": "finished", "wall-seconds": wall}))
    rows = [{"round": 0, "test-score": 0.33, "test-num-examples": 1000}]
    for t, norm in enumerate(norms, start=1):
        row = {
            "round": t,
            "sample-rate": rate,
            "population": 1000,
            "update-norm-median": norm,
            "update-norm-max": 2 * norm,
        }
        if t in tests:
            row |= {"test-score": tests[t], "test-num-examples": 1000}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_wilson_interval_is_the_score_test_inverted():
    # Wilson's interval is the set of p that the score test does not reject at 5%;
    # scipy's binomtest computes it independently ("wilson" method).
    for k, n in ((480, 1000), (0, 50), (50, 50), (17, 40)):
        low, high = wilson_interval(k / n, n)
        ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert (low, high) == pytest.approx((ref.low, ref.high), abs=1e-12)
    with pytest.raises(ValueError, match="at least one example"):
        wilson_interval(0.5, 0)
    with pytest.raises(ValueError, match=r"lies in \[0, 1\]"):
        wilson_interval(1.5, 10)


def test_t_is_the_first_test_round_whose_interval_clears_the_target():
    tests = [ScoredRound(10, 0.45, 1000), ScoredRound(20, 0.49, 1000), ScoredRound(30, 0.53, 1000)]
    # 0.49 over 1,000 examples has a lower end near 0.459: not clear of 0.48 yet
    assert first_round_above(tests, 0.48) == tests[2]
    assert first_round_above(list(reversed(tests)), 0.48) == tests[2]
    assert first_round_above(tests, 0.6) is None


def test_the_sizing_prints_t_c_z_and_the_cost(tmp_path, capsys):
    _run(tmp_path, "fedit", "fedit", {10: 0.40, 20: 0.52, 30: 0.55}, [2.0] * 30, wall=300.0)
    _run(tmp_path, "florg", "florg", {10: 0.36, 20: 0.37}, [0.4, 0.6, 0.5] + [0.5] * 17, wall=80.0)
    assert main([str(tmp_path), "--epsilons", "8", "2"]) == 0
    out = capsys.readouterr().out
    assert "T = 20" in out
    assert "| fedit | 20 | 2 |" in out and "| florg | 20 | 0.5 |" in out  # releases, C
    # the printed z gives the target epsilon back through the accountant, at q = 0.05, T = 20
    z8 = float(out.split("| fedit | 20 | 2 | z = ")[1].split(",")[0])
    assert epsilon_for(z8, 0.05, 20, 1e-4) == pytest.approx(8.0, rel=2e-3)
    assert "noise std " + f"{z8 * 2 / 50:.3g}" in out
    # cost: fedit 10 s a round, 20 rounds, 9 runs = 0.5 h; florg 4 s a round: 0.2 h
    assert "| fedit | 10.0 | 0.06 h | 0.5 h |" in out and "total: 0.7 h" in out


def test_a_pilot_short_of_the_target_says_to_continue_it(tmp_path, capsys):
    _run(tmp_path, "fedit", "fedit", {10: 0.40, 20: 0.44}, [1.0] * 20)
    assert main([str(tmp_path)]) == 1
    assert "not reached in 20 rounds: continue fedit" in capsys.readouterr().out


def test_bad_pilots_are_named(tmp_path, capsys):
    assert main([str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    _run(tmp_path, "florg", "florg", {10: 0.5}, [1.0] * 10)
    assert main([str(tmp_path)]) == 2
    assert "no fedit run" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    with pytest.raises(ValueError, match="not a finished run"):
        load_pilot(tmp_path)
    mixed = tmp_path / "mixed"
    _run(mixed, "a", "fedit", {10: 0.6}, [1.0] * 10, rate=0.05)
    _run(mixed, "b", "florg", {10: 0.6}, [1.0] * 10, rate=0.1)
    assert main([str(mixed)]) == 2
    assert "differ in q" in capsys.readouterr().err
    assert math.isfinite(load_pilot(mixed)[0].seconds_per_round)


def test_round_up_never_rounds_down():
    assert round_up(2.43412, 4) == 2.435
    assert round_up(0.812345, 4) == 0.8124
    assert round_up(1.5, 4) == 1.5  # exact at 4 digits: unchanged
    assert round_up(123456.0, 2) == 130000.0
    with pytest.raises(ValueError, match="positive finite"):
        round_up(0.0)


def test_the_written_grid_is_the_pilot_setting_at_t_with_each_c_and_z(tmp_path, capsys):
    pilot = tmp_path / "pilot"
    _run(pilot, "fedit", "fedit", {10: 0.40, 20: 0.52, 30: 0.55}, [2.0] * 30, wall=300.0)
    _run(pilot, "florg", "florg", {10: 0.36, 20: 0.37}, [0.5] * 20, wall=80.0)
    out_file = tmp_path / "privacy-cross-device.yaml"
    pilot_grid = GRIDS_DIR / "privacy-cross-device-pilot.yaml"
    argv = [str(pilot), "--write-grid", str(out_file), "--pilot-grid", str(pilot_grid)]
    assert main(argv) == 0
    assert f"wrote {out_file}" in capsys.readouterr().out
    text = out_file.read_text()
    assert text.startswith("# Privacy-utility, cross-device, stage 2")
    assert "cross_device_sizing " + " ".join(argv) in text  # the header names its command

    grid = load_grid(out_file)  # checked against the app's schema, as the runner does
    pilot_base = load_grid(pilot_grid).base
    assert grid.name == "privacy-cross-device"
    assert len(grid.runs) == 2 * 3 + 2 * 2 * 3  # {fedit, florg} x (off, 8, 2) x 3 seeds
    for run in grid.runs:
        assert run.setting("num-server-rounds") == 20
        for key, value in pilot_base.items():
            if key != "num-server-rounds":
                assert run.setting(key) == value, key
    private = [r for r in grid.runs if r.setting("dp") == "central"]
    assert len(private) == 12
    assert {r.setting("seed") for r in private} == {0, 1, 2}
    for run in private:
        clip = {"fedit": 2.0, "florg": 0.5}[run.setting("method")]
        assert run.setting("dp-clipping-norm") == clip
        assert run.setting("dp-delta") == 1e-4
        eps = epsilon_for(run.setting("dp-noise-multiplier"), 0.05, 20, 1e-4)
        # rounded up: at most the target, and within the rounding of it
        assert eps <= float(run.blocks[0].rsplit("-eps", 1)[1]) + 1e-9
        assert eps == pytest.approx(float(run.blocks[0].rsplit("-eps", 1)[1]), rel=2e-3)
    assert all(r.setting("dp") == "off" for r in grid.runs if r not in private)
    # twice the slowest method's run (fedit: 10 s a round x 20) is below the pilot's timeout
    assert grid.run_timeout == load_grid(pilot_grid).run_timeout


def test_t_waits_for_every_reference_method(tmp_path, capsys):
    _run(tmp_path, "fedit", "fedit", {10: 0.52, 20: 0.61}, [2.0] * 20)
    _run(tmp_path, "florg", "florg", {10: 0.44, 20: 0.56}, [0.5] * 20)
    assert main([str(tmp_path), "--reference", "fedit", "florg"]) == 0
    out = capsys.readouterr().out
    # fedit's 0.52 over 1,000 examples clears 0.48 at round 10, florg's 0.56 only at 20
    assert "T = 20 (" in out and "fedit 10, florg 20" in out
    assert main([str(tmp_path)]) == 0
    assert "T = 10 (" in capsys.readouterr().out  # fedit alone
    slow = tmp_path / "slow"
    _run(slow, "fedit", "fedit", {10: 0.52}, [2.0] * 10)
    _run(slow, "florg", "florg", {10: 0.40}, [0.5] * 10)
    assert main([str(slow), "--reference", "fedit", "florg"]) == 1
    assert "not reached in 10 rounds: continue florg" in capsys.readouterr().out


def test_a_method_with_a_release_before_round_1_is_sized_for_it(tmp_path, capsys):
    """Fed-SB's round 0 under dp=central is one more release at q (its strategy records it:
    tests/runtime/test_fed_sb.py), so its z covers T + 1 releases; --methods and --name write a
    grid of its own."""
    pilot = tmp_path / "pilot"
    _run(pilot, "fedit", "fedit", {10: 0.52}, [2.0] * 10)
    _run(pilot, "fed-sb", "fed-sb", {10: 0.40}, [0.3] * 10)
    out_file = tmp_path / "fed-sb.yaml"
    pilot_grid = GRIDS_DIR / "privacy-cross-device-pilot.yaml"
    argv = [str(pilot), "--write-grid", str(out_file), "--pilot-grid", str(pilot_grid),
            "--methods", "fed-sb", "--name", "privacy-cross-device-fed-sb"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| fed-sb | 11 | 0.3 |" in out and "| fedit | 10 | 2 |" in out  # releases
    grid = load_grid(out_file)
    assert grid.name == "privacy-cross-device-fed-sb"
    assert {r.setting("method") for r in grid.runs} == {"fed-sb"}
    private = [r for r in grid.runs if r.setting("dp") == "central"]
    assert len(private) == 6
    for run in private:
        target = float(run.blocks[0].rsplit("-eps", 1)[1])
        z = run.setting("dp-noise-multiplier")
        assert epsilon_for(z, 0.05, 11, 1e-4) <= target + 1e-9  # round 0 included
        assert epsilon_for(z, 0.05, 11, 1e-4) == pytest.approx(target, rel=2e-3)
        # sized for the T rounds alone, its z would overshoot the target by round 0
        t_only = round_up(noise_multiplier_for(target, 0.05, 10, 1e-4))
        assert t_only < z and epsilon_for(t_only, 0.05, 11, 1e-4) > target
    assert main([*argv[:-4], "--methods", "flora"]) == 2
    assert "no pilot run of flora" in capsys.readouterr().err


def test_a_method_piloted_again_beside_the_references_earlier_pilot(tmp_path, capsys):
    """Two run folders, the reference methods' in one and a method piloted again in the
    other: the same sizing as one folder holding both, the method's earlier pilot (its
    update norms 0.9) left out."""
    together, earlier, later = tmp_path / "together", tmp_path / "earlier", tmp_path / "later"
    for folder in (together, earlier):
        _run(folder, "fedit", "fedit", {10: 0.52}, [2.0] * 10)
    _run(earlier, "fed-sb", "fed-sb", {10: 0.40}, [0.9] * 10)
    for folder in (together, later):
        _run(folder, "fed-sb", "fed-sb", {10: 0.40}, [0.3] * 10)
    assert main([str(together)]) == 0
    one = capsys.readouterr().out
    assert main([str(earlier), str(later)]) == 0
    assert capsys.readouterr().out == one and "| fed-sb | 11 | 0.3 |" in one
    assert main([str(later)]) == 2  # no reference run there
    assert "no fedit run under" in capsys.readouterr().err


@pytest.mark.parametrize(
    "grid_name",
    ["privacy-cross-device", "privacy-cross-device-fed-sb", "fed-sb-s1-privacy-cross-device"],
)
def test_the_committed_private_grids_are_what_their_commands_write(
    grid_name, tmp_path, capsys, monkeypatch
):
    """Each committed cross-device grid is the file its header's command writes from the
    published pilot, byte for byte: regenerated, never edited."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the command's paths: the repo's
    path = f"lab/grids/{grid_name}.yaml"
    committed = Path(path).read_text()
    command = shlex.split(committed.splitlines()[1].removeprefix("#   "))
    assert command[:3] == ["python", "-m", "florg_lab.cross_device_sizing"]
    argv = command[3:]
    assert argv[argv.index("--write-grid") + 1] == path
    written = tmp_path / f"{grid_name}.yaml"
    argv[argv.index("--write-grid") + 1] = str(written)
    assert main(argv) == 0
    capsys.readouterr()
    assert written.read_text().replace(str(written), path) == committed
