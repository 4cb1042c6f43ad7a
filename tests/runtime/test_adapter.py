"""FLoRG adapter (client side) and the baselines' PEFT LoRA adapters."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import BertForSequenceClassification

from florg_tools.synthetic import tiny_bert_config
from flower_app.adapters.florg.layer import FLoRGLinear, FLoRGProjections
from flower_app.adapters.florg.model import (
    FLoRGConfig,
    export_peft_lora,
    florg_fingerprint,
    florg_layers,
    get_florg_state,
    inject_florg,
    set_florg_state,
)
from flower_app.adapters.florg.projections import fingerprint, make_projections, projection_key
from flower_app.adapters.lora.layer import (
    LoRAConfig,
    get_lora_state,
    inject_lora,
    lora_layers,
    set_lora_state,
)
from flower_app.adapters.targets import adapter_layout
from flower_app.settings.config import ConfigError, defaults, resolve_config

# The shared tiny BERT with 3 labels and an intermediate size of 48:
# query/value are 32x32; intermediate.dense is 48x32 and output.dense 32x48 (both ways).
TINY = tiny_bert_config(num_labels=3, intermediate_size=48)
TARGETS = ("query", "value", "intermediate.dense", "output.dense")


def florg_config(**fields) -> FLoRGConfig:
    """A FLoRGConfig with the run setting's default ``a-init-std`` unless given (the
    adapter declares no default of its own)."""
    return FLoRGConfig(**{"a_init_std": defaults()["a-init-std"], **fields})


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(TINY).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (3, 9), generator=torch.Generator().manual_seed(seed))


def perturb_As(model, scale=0.2, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in florg_layers(model).values():
            layer.A.add_(scale * torch.randn(layer.A.shape, generator=g))


@pytest.mark.parametrize("d_out,d_in", [(12, 7), (7, 12), (9, 9)])
def test_layer_output_equals_dense_formula(d_out, d_in):
    torch.manual_seed(0)
    base = torch.nn.Linear(d_in, d_out).double()
    k, r, s = min(d_in, d_out), 3, 16 / 3
    L, R = make_projections(d_out, d_in, seed=1, name="x")
    A = np.random.default_rng(2).standard_normal((r, k))
    layer = FLoRGLinear(base, L, R, A, s)
    x = torch.randn(5, 4, d_in, dtype=torch.float64)
    W = base.weight.detach().numpy() + s * L @ A.T @ A @ R
    expected = x.numpy() @ W.T + base.bias.detach().numpy()
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["A"]


def test_gradient_matches_paper_formula():
    """grad_A = s A (H + H^T), H = L^T grad_W R^T (paper, eq. gradient_A, with the scaling s)."""
    torch.manual_seed(0)
    d_out, d_in, r = 10, 6, 2
    base = torch.nn.Linear(d_in, d_out, bias=False).double()
    L, R = make_projections(d_out, d_in, seed=0, name="g")
    layer = FLoRGLinear(base, L, R, np.random.default_rng(0).standard_normal((r, 6)), 2.0)
    x, target = (
        torch.randn(8, d_in, dtype=torch.float64),
        torch.randn(8, d_out, dtype=torch.float64),
    )
    loss = ((layer(x) - target) ** 2).sum()
    loss.backward()
    grad_W = (2 * (layer(x) - target).T @ x).detach().numpy()  # dLoss/dW for y = W x
    H = L.T @ grad_W @ R.T
    A = layer.A.detach().numpy()
    np.testing.assert_allclose(layer.A.grad.numpy(), 2.0 * A @ (H + H.T), rtol=1e-10)


@pytest.mark.parametrize("d_out,d_in", [(20, 8), (8, 20)])
def test_projections_semi_orthogonal_and_deterministic(d_out, d_in):
    L, R = make_projections(d_out, d_in, seed=5, name="enc.0.q")
    k = min(d_out, d_in)
    assert L.shape == (d_out, k) and R.shape == (k, d_in)
    np.testing.assert_allclose(L.T @ L, np.eye(k), atol=1e-13)
    np.testing.assert_allclose(R @ R.T, np.eye(k), atol=1e-13)
    L2, R2 = make_projections(d_out, d_in, seed=5, name="enc.0.q")
    assert np.array_equal(L, L2) and np.array_equal(R, R2)
    L3, _ = make_projections(d_out, d_in, seed=5, name="enc.0.v")
    L4, _ = make_projections(d_out, d_in, seed=6, name="enc.0.q")
    assert not np.allclose(L, L3) and not np.allclose(L, L4)


def test_projections_identical_across_processes():
    code = (
        "from flower_app.adapters.florg.projections import make_projections, fingerprint;"
        "print(fingerprint(*make_projections(48, 32, seed=7, name='layer.3.value')))"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    here = fingerprint(*make_projections(48, 32, seed=7, name="layer.3.value"))
    assert runs[0].stdout.strip() == runs[1].stdout.strip() == here
    assert here != fingerprint(*make_projections(48, 32, seed=8, name="layer.3.value"))


def test_kaiming_and_svd_initialisations():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((30, 12))
    L, R = make_projections(30, 12, seed=0, name="w", init="svd", weight=W)
    U, s, Vt = np.linalg.svd(W, full_matrices=False)
    np.testing.assert_allclose(L.T @ L, np.eye(12), atol=1e-12)
    np.testing.assert_allclose(L.T @ W @ R.T, np.diag(s), atol=1e-10)  # W's own singular basis
    Lk, Rk = make_projections(300, 200, seed=0, name="w", init="kaiming")
    assert Lk.shape == (300, 200) and Rk.shape == (200, 200)
    assert Lk.std() == pytest.approx(1 / np.sqrt(200), rel=0.02)
    assert Rk.std() == pytest.approx(1 / np.sqrt(200), rel=0.02)
    with pytest.raises(ValueError, match="needs the weight"):
        make_projections(3, 3, seed=0, name="w", init="svd")
    with pytest.raises(ValueError, match="unknown L/R initialisation"):
        make_projections(3, 3, seed=0, name="w", init="xavier")


def test_injection_freezes_all_but_A_and_head():
    model = tiny_bert()
    layers = inject_florg(model, florg_config(r=4, target_modules=TARGETS))
    assert len(layers) == 2 * 5  # per layer: query, value, intermediate.dense, 2x output.dense
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.A" for n in layers} | {"classifier.weight", "classifier.bias"}
    shapes = {n: tuple(m.A.shape) for n, m in layers.items()}
    assert shapes["bert.encoder.layer.0.intermediate.dense"] == (4, 32)
    assert shapes["bert.encoder.layer.0.output.dense"] == (4, 32)
    state = get_florg_state(model)
    assert set(state) == trainable
    frozen_head = tiny_bert()
    inject_florg(frozen_head, florg_config(r=2, target_modules=("query",), train_head=False))
    assert all(n.endswith(".A") for n, p in frozen_head.named_parameters() if p.requires_grad)


def test_state_roundtrip_and_identical_init_across_builds():
    a, b = tiny_bert(), tiny_bert()
    inject_florg(a, florg_config(target_modules=TARGETS, seed=3))
    inject_florg(b, florg_config(target_modules=TARGETS, seed=3))
    sa, sb = get_florg_state(a), get_florg_state(b)
    assert all(np.array_equal(sa[key], sb[key]) for key in sa)
    assert florg_fingerprint(a) == florg_fingerprint(b)
    perturb_As(a)
    set_florg_state(b, get_florg_state(a))
    x = tokens()
    torch.testing.assert_close(a(x).logits, b(x).logits, rtol=0, atol=0)
    bad = dict(get_florg_state(a))
    key = next(k for k in bad if k.endswith(".A"))
    bad[key] = np.zeros((5, 5), np.float32)
    with pytest.raises(ValueError, match="shape"):
        set_florg_state(b, bad)
    bad[key] = np.full_like(sa[key], np.nan)
    with pytest.raises(ValueError, match="NaN"):
        set_florg_state(b, bad)


def test_subtract_init_leaves_output_unchanged():
    x = tokens()
    reference = tiny_bert()(x).logits
    model = tiny_bert()
    inject_florg(model, florg_config(target_modules=TARGETS, a_init_std=0.3, subtract_init=True))
    torch.testing.assert_close(model(x).logits, reference, rtol=0, atol=1e-5)
    plain = tiny_bert()
    inject_florg(plain, florg_config(target_modules=TARGETS, a_init_std=0.3))
    assert (plain(x).logits - reference).abs().max() > 1e-4  # the paper's default does move it


@pytest.mark.parametrize(
    "subtract_init,sharing", [(False, "shape"), (True, "shape"), (False, "module")]
)
def test_peft_export_reproduces_logits(tmp_path, subtract_init, sharing):
    x = tokens()
    model = tiny_bert()
    config = florg_config(
        r=3,
        target_modules=TARGETS,
        subtract_init=subtract_init,
        a_init_std=0.1,
        projection_sharing=sharing,
    )
    inject_florg(model, config)
    perturb_As(model)
    with torch.no_grad():
        model.classifier.weight.add_(0.5)
    expected = model(x).logits
    assert (expected - tiny_bert()(x).logits).abs().max() > 1e-3
    out = export_peft_lora(model, tmp_path / "adapter")
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(tiny_bert(), out).eval()
    torch.testing.assert_close(loaded(x).logits, expected, rtol=0, atol=1e-5)


def test_florg_bad_input():
    with pytest.raises(ValueError, match="match no nn.Linear"):
        inject_florg(tiny_bert(), florg_config(target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="exceeds k"):
        inject_florg(tiny_bert(), florg_config(r=33, target_modules=("query",)))
    with pytest.raises(ConfigError, match="a-init-std"):  # A = 0 is a stationary point
        resolve_config({}, {"a-init-std": 0.0})
    with pytest.raises(ValueError, match="r must be"):
        florg_config(r=0)
    with pytest.raises(ValueError, match="projection_init"):
        florg_config(projection_init="orthogonal")
    model = tiny_bert()
    inject_florg(model, florg_config(target_modules=("query",)))
    with pytest.raises(ValueError, match="already carries"):
        inject_florg(model, florg_config(target_modules=("value",)))


def test_adapter_layout_counts_shapes_and_head():
    shapes, head = adapter_layout(tiny_bert(), ("query", "intermediate.dense"), None)
    assert shapes["bert.encoder.layer.1.intermediate.dense"] == (48, 32)
    assert len(shapes) == 4
    assert head == 32 * 3 + 3


# ---------------------------------------------------------------- PEFT LoRA baselines


def test_lora_seeded_init_identical_across_nodes_and_B_zero():
    a = inject_lora(tiny_bert(), LoRAConfig(r=2, target_modules=TARGETS, seed=4))
    b = inject_lora(tiny_bert(), LoRAConfig(r=2, target_modules=TARGETS, seed=4))
    sa, sb = get_lora_state(a), get_lora_state(b)
    assert set(sa) == set(sb)
    for key in sa:
        assert np.array_equal(sa[key], sb[key]), key
        if key.endswith("lora_B"):
            assert not sa[key].any()
    # B = 0 at the start: the LoRA model equals the base model.
    x = tokens()
    torch.testing.assert_close(a(x).logits, tiny_bert()(x).logits, rtol=0, atol=1e-6)


def test_lora_scaling_and_transposes_on_non_square_layer():
    model = inject_lora(
        tiny_bert(), LoRAConfig(r=2, alpha=6, target_modules=("intermediate.dense",))
    )
    name = "bert.encoder.layer.0.intermediate.dense"
    layer = lora_layers(model)[name]
    state = get_lora_state(model)
    assert state[f"{name}.lora_B"].shape == (48, 2) and state[f"{name}.lora_A"].shape == (2, 32)
    rng = np.random.default_rng(0)
    state[f"{name}.lora_B"] = rng.standard_normal((48, 2)).astype(np.float32)
    set_lora_state(model, state)
    x = torch.randn(4, 32)
    W0 = layer.get_base_layer().weight.detach().numpy()
    bias = layer.get_base_layer().bias.detach().numpy()
    B, A = state[f"{name}.lora_B"], state[f"{name}.lora_A"]
    expected = x.numpy() @ (W0 + 3.0 * B @ A).T + bias  # s = alpha / r = 3
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-5, atol=1e-5)


def test_ffa_freezes_A_and_fedsa_state_excludes_B():
    model = inject_lora(tiny_bert(), LoRAConfig(r=2, target_modules=("query",), freeze_A=True))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and not any("lora_A" in n for n in trainable)
    assert any("lora_B" in n for n in trainable)
    sent = get_lora_state(model, parts=("A",))
    assert not any(k.endswith("lora_B") for k in sent)
    assert {k for k in sent if not k.endswith("lora_A")} == {"classifier.weight", "classifier.bias"}


def test_federa_svd_init_keeps_output_and_uses_principal_directions():
    x = tokens()
    model = inject_lora(tiny_bert(), LoRAConfig(r=2, target_modules=TARGETS, init="svd"))
    torch.testing.assert_close(model(x).logits, tiny_bert()(x).logits, rtol=0, atol=1e-4)
    name = "bert.encoder.layer.0.attention.self.query"
    W0 = tiny_bert().bert.encoder.layer[0].attention.self.query.weight.detach().double().numpy()
    s = np.linalg.svd(W0, compute_uv=False)
    layer = lora_layers(model)[name]
    BA = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach().double()
    np.testing.assert_allclose(
        np.linalg.svd(layer.scaling["default"] * BA.numpy(), compute_uv=False)[:2], s[:2], rtol=1e-4
    )


def test_fedex_fold_sets_w0_plus_scaled_residual_and_restores_w0():
    """FedEx-LoRA's hook: W0 <- W0_pristine + s * cumulative residual; {} restores W0."""
    from flower_app.settings.config import resolve_config
    from strategies.fedex_lora.method import FEDEX_LORA
    from strategies.shared.folds import fold_residual

    PRISTINE = FEDEX_LORA.pristine_key
    assert PRISTINE == "fedex-pristine-W0"  # the key its published runs' processes used

    class Holder:  # what the hook needs of an AdaptedModel
        def __init__(self, model):
            self.model, self.held_tensors = model, {}

    rng = np.random.default_rng(1)
    adapted = Holder(inject_lora(tiny_bert(), LoRAConfig(r=2, target_modules=("value",))))
    FEDEX_LORA.prepare_model(adapted)
    names = list(lora_layers(adapted.model))
    assert set(adapted.held_tensors[PRISTINE]) == set(names)
    residual = {n: rng.standard_normal((32, 32)) for n in names}
    x = tokens()
    before = adapted.model(x).logits
    fold_residual(adapted, residual, PRISTINE)
    for name, layer in lora_layers(adapted.model).items():
        expected = adapted.held_tensors[PRISTINE][name].double() + layer.scaling[
            "default"
        ] * torch.as_tensor(residual[name])
        torch.testing.assert_close(
            layer.get_base_layer().weight, expected.float(), rtol=0, atol=1e-6
        )
    assert (adapted.model(x).logits - before).abs().max() > 1e-3
    fold_residual(adapted, {}, PRISTINE)
    torch.testing.assert_close(adapted.model(x).logits, before, rtol=0, atol=0)
    assert resolve_config({"method": "fedex-lora"}).method == FEDEX_LORA.name


def test_lora_bad_input():
    with pytest.raises(ValueError, match="exceeds k"):
        inject_lora(tiny_bert(), LoRAConfig(r=40, target_modules=("query",)))
    with pytest.raises(ValueError, match="match no nn.Linear"):
        inject_lora(tiny_bert(), LoRAConfig(target_modules=("nope",)))
    with pytest.raises(ValueError, match="LoRA init"):
        LoRAConfig(init="pissa")


# --- L/R sharing (projection-sharing) ---------------------------------------------------


def test_shape_sharing_holds_one_pair_per_shape():
    model = tiny_bert()
    layers = inject_florg(model, florg_config(target_modules=TARGETS, seed=4))
    by_shape: dict[tuple[int, int], list[FLoRGLinear]] = {}
    for layer in layers.values():
        by_shape.setdefault(tuple(layer.base_layer.weight.shape), []).append(layer)
    assert sorted(by_shape) == [(32, 32), (32, 48), (48, 32)]
    for (d_out, d_in), group in by_shape.items():
        assert len(group) >= 2
        assert all(g.projections is group[0].projections for g in group)
        assert all(g.L.data_ptr() == group[0].L.data_ptr() for g in group)
        L, R = make_projections(d_out, d_in, seed=4, name=f"shape:{d_out}x{d_in}")
        np.testing.assert_array_equal(group[0].L.numpy(), L.astype(np.float32))
        np.testing.assert_array_equal(group[0].R.numpy(), R.astype(np.float32))
        k = min(d_out, d_in)
        np.testing.assert_allclose(L.T @ L, np.eye(k), atol=1e-13)
        np.testing.assert_allclose(R @ R.T, np.eye(k), atol=1e-13)
    # Buffers are counted once: 3 shapes x (L + R), not 16 layers x (L + R).
    assert len(list(model.buffers())) == len(list(tiny_bert().buffers())) + 6
    # The A matrices still differ per module (seeded by name).
    A = [layer.A.detach().numpy() for layer in by_shape[(32, 32)]]
    assert not np.allclose(A[0], A[1])


def test_module_sharing_is_the_per_module_derivation():
    model = tiny_bert()
    layers = inject_florg(
        model, florg_config(target_modules=TARGETS, seed=4, projection_sharing="module")
    )
    holders = {id(layer.projections) for layer in layers.values()}
    assert len(holders) == len(layers)
    for name, layer in layers.items():
        d_out, d_in = layer.base_layer.weight.shape
        L, R = make_projections(d_out, d_in, seed=4, name=name)
        np.testing.assert_array_equal(layer.L.numpy(), L.astype(np.float32))
        np.testing.assert_array_equal(layer.R.numpy(), R.astype(np.float32))
    assert projection_key("m", 3, 4, "module", "semi-orthogonal") == "m"
    assert projection_key("m", 3, 4, "shape", "semi-orthogonal") == "shape:3x4"
    assert projection_key("m", 3, 4, "shape", "svd") == "m"  # W0-dependent: per module
    with pytest.raises(ValueError, match="projection sharing"):
        projection_key("m", 3, 4, "layer", "semi-orthogonal")
    with pytest.raises(ValueError, match="projection_sharing"):
        florg_config(projection_sharing="layer")


def test_shared_projections_keep_the_dense_formula_and_survive_conversion():
    torch.manual_seed(0)
    d_out, d_in, r, s = 12, 7, 3, 2.0
    L, R = make_projections(d_out, d_in, seed=1, name="shape:12x7")
    holder = FLoRGProjections(L, R, torch.float64, torch.device("cpu"))
    bases = [torch.nn.Linear(d_in, d_out).double() for _ in range(2)]
    rng = np.random.default_rng(2)
    As = [rng.standard_normal((r, d_in)) for _ in range(2)]
    layers = torch.nn.ModuleList(
        FLoRGLinear(b, L, R, a, s, projections=holder) for b, a in zip(bases, As, strict=True)
    )
    x = torch.randn(5, d_in, dtype=torch.float64)
    for layer, base, A in zip(layers, bases, As, strict=True):
        W = base.weight.detach().numpy() + s * L @ A.T @ A @ R
        expected = x.numpy() @ W.T + base.bias.detach().numpy()
        np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    layers.float()  # converts the shared holder once, in place: still one pair
    assert layers[0].L.dtype == torch.float32
    assert layers[0].L.data_ptr() == layers[1].L.data_ptr()
    with pytest.raises(ValueError, match="do not fit"):
        FLoRGLinear(torch.nn.Linear(5, 5), L, R, As[0], s, projections=holder)


def test_fingerprint_covers_the_sharing_mode():
    prints = {}
    for sharing in ("shape", "module"):
        a, b = tiny_bert(), tiny_bert()
        for m in (a, b):
            inject_florg(m, florg_config(target_modules=TARGETS, projection_sharing=sharing))
        assert florg_fingerprint(a) == florg_fingerprint(b)
        prints[sharing] = florg_fingerprint(a)
    assert prints["shape"] != prints["module"]
    # The mode is hashed too: svd L, R are per module in both modes, yet the prints differ.
    svd = {}
    for sharing in ("shape", "module"):
        m = tiny_bert()
        inject_florg(
            m,
            florg_config(
                target_modules=("query",), projection_init="svd", projection_sharing=sharing
            ),
        )
        svd[sharing] = florg_fingerprint(m)
    assert svd["shape"] != svd["module"]
