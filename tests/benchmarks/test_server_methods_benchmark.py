"""Every method's server step benchmark (benchmarks/core/server_methods.py) at the tiny
``quick`` shape on the CPU: every method runs and has one row, FLoRG's ratio is 1, and
what each timed round computes equals the method's rule on the same payloads (so the
benchmark times the real thing). No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.core.server_methods import (
    SHAPES,
    Case,
    build_case,
    main,
    run,
    table,
)
from flower_app.methods.contract import adapter_layers, stacked
from flower_app.methods.registry import method_names


def rule_reference(case: Case) -> dict[str, np.ndarray]:
    """The method's rule functions (its numpy reference) on the case's payloads: the new
    arrays the round must return, and each layer's fold into W0 as 'fold:<layer>'."""
    from strategies.fed_sb.rule import aggregate_fed_sb
    from strategies.federa.rule import aggregate_federa
    from strategies.fedex_lora.rule import aggregate_fedex_lora
    from strategies.fedit.rule import aggregate_fedit
    from strategies.fedrot_lora.rule import aggregate_fedrot_lora
    from strategies.fedsa_lora.rule import aggregate_fedsa_lora
    from strategies.fedsvd.rule import aggregate_fedsvd
    from strategies.ffa_lora.rule import aggregate_ffa_lora
    from strategies.flexlora.rule import aggregate_flexlora
    from strategies.flora.rule import stack_flora
    from strategies.florg.rule import aggregate_florg
    from strategies.florg_signed.rule import aggregate_florg_signed
    from strategies.hetlora.rule import aggregate_hetlora
    from strategies.rolora.rule import aggregate_rolora

    name, p, w = case.name, case.payloads, case.weights
    sent = case.strategy.global_state
    r = SHAPES["quick"].rank
    out: dict[str, np.ndarray] = {}
    for layer in adapter_layers(sent):
        kA, kb, ka, kR = f"{layer}.A", f"{layer}.lora_B", f"{layer}.lora_A", f"{layer}.R"
        if name in ("florg", "florg-no-procrustes"):
            out[kA] = aggregate_florg(stacked(p, kA), w, sent[kA], procrustes=name == "florg")[0]
        elif name == "florg-signed":
            out[kA] = aggregate_florg_signed(stacked(p, kA), w, sent[kA])[0]
        elif name == "fedit":
            out[kb], out[ka] = aggregate_fedit(stacked(p, kb), stacked(p, ka), w)
        elif name == "federa":
            out[kb], out[ka], _ = aggregate_federa(stacked(p, kb), stacked(p, ka), w)
        elif name == "ffa-lora":
            out[kb] = aggregate_ffa_lora(stacked(p, kb), w)
        elif name == "fedsa-lora":
            out[ka] = aggregate_fedsa_lora(stacked(p, ka), w)
        elif name == "fedex-lora":
            out[kb], out[ka], res = aggregate_fedex_lora(stacked(p, kb), stacked(p, ka), w)
            out[f"fold:{layer}"] = res.to_dense()
        elif name == "hetlora":
            out[kb], out[ka] = aggregate_hetlora(stacked(p, kb), stacked(p, ka), w, rank=r)
        elif name == "flexlora":
            out[kb], out[ka], _ = aggregate_flexlora(stacked(p, kb), stacked(p, ka), w, rank=r)
        elif name == "rolora":  # round 1 trains B; A stays as sent
            out[kb], out[ka] = aggregate_rolora(stacked(p, kb), w), sent[ka]
        elif name == "fedsvd":
            out[kb], out[ka] = aggregate_fedsvd(stacked(p, kb), sent[ka], w)
        elif name == "flora":  # the new B, A are the next round's fresh LoRA; the fold counts
            out[f"fold:{layer}"] = stack_flora(stacked(p, kb), stacked(p, ka), w).to_dense()
        elif name == "fed-sb":
            out[kR] = aggregate_fed_sb(stacked(p, kR), w)
        elif name == "fedrot-lora":  # round 1 rotates nothing (None): the factor-wise means
            out[kb], out[ka], _ = aggregate_fedrot_lora(
                stacked(p, kb), stacked(p, ka), w, sent[kb], sent[ka], None
            )
        else:
            raise AssertionError(f"no reference for {name!r}: add it here")
    return out


@pytest.mark.parametrize("name", method_names())
def test_the_timed_round_computes_the_methods_rule(name):
    case = build_case(name, SHAPES["quick"], layers=3, device="cpu")
    new, _ = case.round()
    got = {**new, **{f"fold:{layer}": fold for layer, fold in case.folds().items()}}
    want = rule_reference(case)
    assert want and set(want) <= set(got)
    for key, ref in want.items():
        diff = np.linalg.norm(got[key] - ref) / max(np.linalg.norm(ref), 1e-300)
        assert diff < 1e-9, (name, key, diff)
    # what travels up is what the method counts (build_case checks it too)
    assert case.received_params == sum(a.size for pl in case.payloads for a in pl.values())
    if case.step is not None:  # the rule alone runs on the same payloads
        case.step()


def test_every_method_has_one_row_and_florgs_ratio_is_one():
    result = run("quick", "cpu", repeats=1)
    names = [row["method"] for row in result["rows"]]
    assert names == list(method_names())  # FLoRG first: the registry's order
    rows = {row["method"]: row for row in result["rows"]}
    assert rows["florg"]["ratio_to_florg"] == 1.0
    assert rows["florg"]["step_ratio_to_florg_step"] == 1.0
    assert all(row["round_s"] > 0 and row["received_params"] > 0 for row in rows.values())
    assert rows["fed-sb"]["received_params"] == 5 * 4 * 4 * 4  # N clients x layers x r^2
    text = table(result)
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(names)  # the header row, one row per method
    assert text.startswith("# server step of every method, shape quick: 4 layers, k = 64")


def test_the_thread_count_is_put_back_for_the_caller():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = run("quick", "cpu", methods=["fedit"], repeats=1, threads=1, memory=False)
        assert result["threads"] == 1  # it timed at the count asked for
        assert torch.get_num_threads() == 2  # and the process has its own back
    finally:
        torch.set_num_threads(before)


def test_a_subset_gets_florg_added_and_layers_are_cut(capsys):
    main(["--shape", "quick", "--methods", "fedit", "--repeats", "1", "--layers", "2",
          "--no-memory"])  # fmt: skip
    text = capsys.readouterr().out
    assert "2 layers of the shape's 4" in text
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["florg", "fedit"]


def test_unknown_method_and_missing_cuda_are_refused():
    with pytest.raises(SystemExit, match=r"unknown method 'fedfoo'; choose one of florg"):
        main(["--shape", "quick", "--methods", "fedfoo"])
    with pytest.raises(ValueError, match=r"unknown shape '13b'; shapes: roberta-large, 7b"):
        run("13b")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--device cuda: CUDA is not available"):
            main(["--shape", "quick", "--device", "cuda"])


@pytest.mark.parametrize("server_round, part", [(2, "A"), (3, "B")])
def test_a_later_round_times_fedrot_loras_rotation(server_round, part):
    """``--round``: from round 2 FedRot-LoRA rotates each reply (A in even rounds, B in odd)
    before its means; the timed round is the rule's at that round, not round 1's plain means."""
    from strategies.fedrot_lora.rule import aggregate_fedrot_lora
    from strategies.shared.per_layer import LORA_PARTS, layer_keys

    case = build_case("fedrot-lora", SHAPES["quick"], layers=2, device="cpu",
                      server_round=server_round)  # fmt: skip
    new, _ = case.round()
    sent, p, w = case.strategy.global_state, case.payloads, case.weights
    for kb, ka in layer_keys(sent, LORA_PARTS):
        B, A, moved = aggregate_fedrot_lora(stacked(p, kb), stacked(p, ka), w, sent[kb],
                                            sent[ka], part)  # fmt: skip
        plain_B, plain_A, _ = aggregate_fedrot_lora(stacked(p, kb), stacked(p, ka), w,
                                                    sent[kb], sent[ka], None)  # fmt: skip
        np.testing.assert_allclose(new[kb], B, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(new[ka], A, rtol=1e-9, atol=1e-12)
        assert moved > 0 and not np.allclose(new[ka], plain_A)
    text = table(run("quick", "cpu", methods=["fedrot-lora"], repeats=1, memory=False,
                     server_round=server_round))  # fmt: skip
    assert f"round {server_round};" in text
    with pytest.raises(ValueError, match="--round must be >= 1"):
        run("quick", "cpu", methods=["fedit"], repeats=1, memory=False, server_round=0)
