"""The causal-LM task kind (flower_app/task_kinds/causal_lm.py): the response-only loss
mask, the prompt templates, the generative metrics, the task sources, every method's client
round on the tiny decoder in process, and the methods whose round touches the task kind
beyond the shared arrays through the Flower simulation (tests/conftest.py's synthetic
assets)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch

from florg_tools.flwr_cli import run_flower_app
from florg_tools.synthetic import make_generative_qa_task, make_tiny_causal_lm
from flower_app.data import sft
from flower_app.data.tasks import TASKS
from flower_app.methods.contract import Method
from flower_app.methods.registry import method_names
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.task_kinds.sft_eval import generate_answers, generation_scores, response_loss
from tests.harness.ray_harness import shared_ray_simulation_superlink

NUM_NODES = 2
# The decoder through the simulation: the methods whose round touches the task kind beyond
# the shared arrays -- FLoRG (its Gram step, the PEFT export of a decoder), FedSA-LoRA (the
# clients' personalised generative scores), FedEx-LoRA and FLoRA (their updates folded into
# the decoder's W0 on every node), Fed-SB (round 0: its clients' gradients of the causal
# loss, asked by a query message), FedSVD (the server re-factorises the frozen A) and
# RoLoRA (B and A in alternate rounds). The other server rules (FedIT, FeDeRA, FFA-LoRA,
# HetLoRA, FlexLoRA, FLoRG's variants) do not depend on the task kind
# (flower_app/task_kinds/) and run end to end on classification (test_app_e2e.py); every
# method's causal-LM round runs in process below.
E2E_METHODS = ["florg", "fedsa-lora", "fedex-lora", "flora", "fed-sb", "fedsvd", "rolora"]
CHAT_TEMPLATE = (
    "{% for m in messages %}[CLS] {{ m['role'] }} {{ m['content'] }} [SEP]{% endfor %}"
    "{% if add_generation_prompt %}[CLS] assistant{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("causal")
    return make_tiny_causal_lm(base / "model"), make_generative_qa_task(base / "task")


@pytest.fixture(scope="module")
def tokenizer(tiny) -> Any:
    from flower_app.modeling import load_tokenizer

    return load_tokenizer(str(tiny[0]))


def causal_settings(tiny, **settings: Any) -> dict[str, Any]:
    model, task = tiny
    return {
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "task-kind": "causal-lm",
        "text-fields": "question,context",
        "label-field": "answers",
        "max-seq-length": 48,
        "max-new-tokens": 3,
        "batch-size": 8,
        **settings,
    }


# --------------------------------------------------------------------------- the loss mask


def test_only_response_tokens_are_labelled_and_long_prompts_lose_their_start():
    packed = sft.pack_pair([1, 2, 3], [7, 8, 9], max_length=8, pad_id=0)
    assert packed["input_ids"] == [1, 2, 3, 7, 8, 9, 0, 0]
    assert packed["attention_mask"] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert packed["labels"] == [-100, -100, -100, 7, 8, 9, -100, -100]
    cut = sft.pack_pair(list(range(10, 20)), [7, 8, 9, 6, 5], max_length=6, pad_id=0)
    # The response keeps half the length, the prompt its end (the question near the answer).
    assert cut["input_ids"] == [17, 18, 19, 7, 8, 9]
    assert cut["labels"] == [-100, -100, -100, 7, 8, 9]


def test_features_label_the_response_and_eos_and_the_loss_counts_only_them(tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    examples = datasets.Dataset.from_dict(
        {
            sft.PROMPT: ["Context: the movie was good\nQuestion: what\nAnswer:"],
            sft.RESPONSE: [" good"],
        }
    )
    features = sft.sft_features(examples, tokenizer, 32, "plain")
    row = features[0]
    labelled = row["labels"][row["labels"] != -100].tolist()
    assert labelled == [tokenizer.convert_tokens_to_ids("good"), tokenizer.eos_token_id]
    assert row["input_ids"][0] == tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    loader = torch.utils.data.DataLoader(features, batch_size=1)
    ours, tokens = response_loss(model, loader, torch.device("cpu"))
    batch = next(iter(loader))
    with torch.no_grad():
        theirs = float(model(**batch).loss)  # transformers' shifted loss over labels != -100
    assert tokens == 2 and ours == pytest.approx(theirs, rel=1e-5)
    # Every token labelled: a different (larger-count) loss, so the mask is what counts.
    batch["labels"] = torch.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
    with torch.no_grad():
        assert float(model(**batch).loss) != pytest.approx(theirs)


def test_the_chat_template_is_the_tokenizers_or_a_clear_error(tiny, tokenizer):
    from flower_app.task_data import tokenized_split

    with pytest.raises(ValueError, match="has no chat template; use prompt-template=plain"):
        sft.prompt_ids(tokenizer, "what", "chat")
    config = resolve_config({}, causal_settings(tiny, **{"prompt-template": "chat"}))
    with pytest.raises(ConfigError, match="prompt-template: .*no chat template"):
        tokenized_split(config, "train")
    chat = type(tokenizer).from_pretrained(tiny[0])
    chat.chat_template = CHAT_TEMPLATE
    ids = sft.prompt_ids(chat, "the movie ", "chat")
    assert chat.decode(ids) == "[CLS] [UNK] the movie [SEP] [CLS] [UNK]"  # user, assistant: UNK
    assert sft.response_ids(chat, " good", "chat") == [
        chat.convert_tokens_to_ids("good"),
        chat.eos_token_id,
    ]
    with pytest.raises(ConfigError, match="prompt-template: bad value 'alpaca'"):
        resolve_config({}, {"prompt-template": "alpaca"})


# --------------------------------------------------------------------------- metrics


def test_generation_is_scored_by_squad_em_and_f1_over_all_gold_answers():
    scores = generation_scores(
        ["The cat.", "a dog", "nothing"], [["cat", "kitten"], ["big dog", "dog"], ["x y"]]
    )
    assert scores["gen-exact-match"] == pytest.approx(100 * 2 / 3)
    assert scores["gen-f1"] == pytest.approx(100 * 2 / 3)
    partial = generation_scores(["big red dog"], [["big dog"]])
    assert partial["gen-exact-match"] == 0 and partial["gen-f1"] == pytest.approx(80.0)
    with pytest.raises(ValueError, match="2 predictions for 1 examples"):
        generation_scores(["a", "b"], [["a"]])


def test_batched_greedy_generation_equals_one_prompt_at_a_time(tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    prompts = [
        sft.prompt_ids(tokenizer, text, "plain")
        for text in ("the movie was", "a film and the plot is very", "good", "the actor was bad")
    ]
    cpu = torch.device("cpu")
    batched = generate_answers(model, prompts, tokenizer, cpu, max_new_tokens=4, batch_size=4)
    alone = generate_answers(model, prompts, tokenizer, cpu, max_new_tokens=4, batch_size=1)
    assert batched == alone and len(batched) == 4


# --------------------------------------------------------------------------- tasks


def test_generative_tasks_and_their_sources():
    assert TASKS["squad-gen"].kind == TASKS["snli-gen"].kind == "causal-lm"
    assert TASKS["squad-gen"].asset == TASKS["squad"].asset == "squad"
    from flower_app.task_kinds.causal_lm import source_format

    assert [source_format(TASKS[t]) for t in ("squad-gen", "snli-gen", "vicgalle/alpaca-gpt4")] == [
        "squad", "labels", "instructions",
    ]  # fmt: skip
    snli = datasets.Dataset.from_dict(
        {"premise": ["a man"], "hypothesis": ["a person"], "label": [0]},
        features=datasets.Features(
            {
                "premise": datasets.Value("string"),
                "hypothesis": datasets.Value("string"),
                "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
            }
        ),
    )
    row = sft.from_classification(snli, ("premise", "hypothesis"), "label")[0]
    assert row[sft.RESPONSE] == " entailment" and row[sft.ANSWERS] == ["entailment"]
    assert "Premise: a man\nHypothesis: a person\n" in row[sft.PROMPT]
    alpaca = datasets.Dataset.from_dict(
        {"instruction": ["Add.", "Greet."], "input": ["1 and 2", ""], "output": ["3", "Hello"]}
    )
    rows = sft.from_instructions(alpaca, ("instruction", "input"), "output")
    assert rows[0][sft.PROMPT] == "### Instruction:\nAdd.\n\n### Input:\n1 and 2\n\n### Response:\n"
    assert rows[1][sft.PROMPT] == "### Instruction:\nGreet.\n\n### Response:\n"
    assert rows[1][sft.RESPONSE] == "Hello" and rows[1][sft.ANSWERS] == []
    with pytest.raises(ValueError, match=r"missing column\(s\) \['response'\]"):
        sft.from_instructions(alpaca, ("instruction",), "response")


def test_a_round_adapts_q_and_v_and_instructions_are_scored_by_their_loss(tiny, tmp_path):
    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.client.round import train_round
    from flower_app.task_data import load_task_data
    from flower_app.task_eval import evaluate_task

    config = resolve_config({}, causal_settings(tiny, **{"local-steps": 2}))
    data = load_task_data(config)
    adapted = cached_adapted_model.__wrapped__(config, data.num_labels, data.spec.kind)
    assert sorted({k.rsplit(".", 1)[0].rsplit(".", 1)[-1] for k in adapted.shared_state()}) == [
        "q_proj",
        "v_proj",
    ]
    reply = train_round(config, adapted, server_round=1, partition_id=0, num_partitions=2)
    assert reply.metrics["steps"] == 2 and math.isfinite(reply.metrics["train-loss"])
    metrics = evaluate_task(config, adapted.model, torch.device("cpu"))
    assert set(metrics) == {
        "response-loss", "perplexity", "gen-exact-match", "gen-f1", "loss", "score",
        "num-examples",
    }  # fmt: skip
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["response-loss"]))
    assert metrics["score"] == metrics["gen-f1"] / 100 and metrics["num-examples"] == 24
    # Instructions (Alpaca format, no short answers): loss and perplexity only.
    task = tmp_path / "alpaca.jsonl"
    task.write_text(
        "".join(
            json.dumps({"instruction": "the movie was", "input": w, "output": w}) + "\n"
            for w in ["good", "bad", "fine", "sad"] * 5
        )
    )
    alpaca = resolve_config(
        {},
        causal_settings(
            tiny, **{"data-path": str(task), "text-fields": "instruction,input",
                     "label-field": "output", "target-modules": "k_proj"}
        ),
    )  # fmt: skip
    scored = evaluate_task(alpaca, adapted.model, torch.device("cpu"))
    assert "gen-f1" not in scored and scored["score"] == -scored["response-loss"]
    other = cached_adapted_model.__wrapped__(alpaca, 0, "causal-lm")
    assert all(".k_proj." in k for k in other.shared_state())  # an explicit setting wins


def fed_sb_round_0(adapted: Any, gradients: dict, lr: float, rank: int) -> None:
    """Fed-SB's server step of round 0 in process, for one client's answer: each layer's
    B, R, A from its gradient (strategies/fed_sb/rule.py's ``initial_factors``, as the
    strategy computes them from the clients' mean), B and A fixed in the model, R loaded as
    the global state the first training message carries."""
    from flower_app.adapters.lora_sb.layer import lora_sb_layers, set_lora_sb_basis
    from strategies.fed_sb.gradient import gradient_key
    from strategies.fed_sb.rule import initial_factors

    basis, shared = {}, {}
    for layer in lora_sb_layers(adapted.model):
        gradient = gradients[gradient_key(layer)].astype("float64")
        B, R, A = initial_factors(gradient, lr, rank)
        basis[f"{layer}.B"], basis[f"{layer}.A"], shared[f"{layer}.R"] = B, A, R
    set_lora_sb_basis(adapted.model, basis)
    adapted.load_shared_state(shared)


@pytest.mark.parametrize("method", method_names())
def test_every_method_trains_the_decoder_in_process(tiny, method):
    """One client round of every method on the tiny decoder, in process (the ClientApp's
    round, flower_app/client/round.py; a method that runs a round 0 answers its query
    first), then the server's generative evaluation: the shared arrays move, the loss
    counts response tokens, the four causal-LM keys are finite and the score is gen-F1."""
    import numpy as np

    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.client.round import local_batches, train_round
    from flower_app.task_data import load_task_data
    from flower_app.task_eval import evaluate_task

    settings = {"method": method, "rank": 2, "local-steps": 2, "learning-rate": 0.01}
    config = resolve_config({}, causal_settings(tiny, **settings))
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels, data.spec.kind)
    if type(adapted.method).answer_query is not Method.answer_query:  # Fed-SB's round 0
        gradients, _ = adapted.method.answer_query(
            config, adapted, local_batches(config, 0, NUM_NODES)
        )
        assert gradients and all(np.all(np.isfinite(g)) for g in gradients.values()), method
        fed_sb_round_0(adapted, gradients, config.learning_rate, config.rank)
    before = {k: v.copy() for k, v in adapted.shared_state().items()}
    reply = train_round(config, adapted, server_round=1, partition_id=0, num_partitions=NUM_NODES)
    assert reply.metrics["steps"] == 2 and reply.metrics["train-loss"] > 0
    assert math.isfinite(reply.metrics["train-loss"])
    moved = [k for k in reply.shared if not np.array_equal(reply.shared[k], before[k])]
    assert moved, method
    scores = evaluate_task(config, adapted.model, torch.device("cpu"))
    for key in ("response-loss", "perplexity", "gen-exact-match", "gen-f1"):
        assert math.isfinite(scores[key]), (key, scores)
    assert scores["score"] == scores["gen-f1"] / 100


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    # One Ray cluster for the module's runs (tests/harness/ray_harness.py says why).
    with shared_ray_simulation_superlink(
        tmp_path_factory.mktemp("causal-sim"), num_supernodes=NUM_NODES
    ) as sim:
        yield sim


@pytest.mark.integration
@pytest.mark.parametrize("method", E2E_METHODS)
def test_causal_lm_trains_end_to_end_through_the_flower_simulation(
    tiny, superlink, tmp_path, method
):
    """The method fine-tunes the tiny decoder for one round through the Flower simulation
    (one SuperLink for the module) and writes the four causal-LM metric keys."""
    root = Path(__file__).resolve().parents[2]
    config = {
        **causal_settings(tiny),
        "method": method,
        "rank": 2,
        "num-server-rounds": 1,
        "min-available-nodes": NUM_NODES,
        "client-eval": "on",
        "output-dir": str(tmp_path / "outputs"),
        "run-name": f"causal-{method}",
    }
    home, connection = superlink
    outcome = run_flower_app(root, connection, config, home, timeout=600, stream=None)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    run_dir = tmp_path / "outputs" / f"causal-{method}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        assert row["score-metric"] == "gen-f1"
        for key in ("response-loss", "perplexity", "gen-exact-match", "gen-f1"):
            assert math.isfinite(row[key]), (key, row)
        assert row["score"] == row["gen-f1"] / 100
    assert rows[1]["train-loss"] > 0 and rows[1]["up-params"] > 0
    # the clients' own evaluation (FedSA-LoRA's personalised models among them)
    assert math.isfinite(rows[1]["personalized-response-loss"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final-gen-f1"] == rows[1]["gen-f1"]


def test_the_console_line_names_the_generative_scores_or_the_loss():
    from flower_app.task_kinds import get_kind

    kind = get_kind("causal-lm")
    row = {"response-loss": 2.0, "perplexity": 7.389, "gen-exact-match": 10.0, "gen-f1": 25.5}
    assert kind.console(row) == "response loss 2.0000 ppl 7.39 gen EM 10.00 F1 25.50"
    assert kind.console({"response-loss": 2.0, "perplexity": 7.389}) == (
        "response loss 2.0000 ppl 7.39"
    )
    assert kind.console({"personalized-gen-f1": 30.0}, "personalized-") == "personal gen-F1 30.00"
    assert kind.console({"accuracy": None}) is None
