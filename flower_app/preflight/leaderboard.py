"""The FlowerTune LLM leaderboard (flower.ai/benchmarks/llm-leaderboard): its four tracks and the
rules an entry keeps, checked on a run's settings (docs/flowertune.md).

Taken from flwrlabs/flower at commit ``TEMPLATE_COMMIT`` (the templates
``examples/flowertune-llm-<track>/`` and ``benchmarks/flowertune-llm/evaluation/<track>/``). The
rules: the static config (``STATIC_KEYS``: every setting that decides which examples train),
the number of SuperNodes each README names, the communication budget (200,000 MB, MB being
bytes / 1024² of every training message's arrays, down and up) and one global PEFT checkpoint
(``check_method``: no personal parts, no writes into the base weights). Each check raises a
``ConfigError`` whose message starts with ``leaderboard`` and names the rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flower_app.methods.registry import get_method
from flower_app.settings.config import ConfigError, RunConfig

TEMPLATE_REPO = "flwrlabs/flower"
TEMPLATE_COMMIT = "59d77930cdd9fe91dce975df243b571db85c3fd9"
BUDGET_MB = 200_000.0
BYTES_PER_MB = 1024**2  # the templates' MB
LIFT = "--set leaderboard=false lifts the leaderboard's checks"


@dataclass(frozen=True)
class Track:
    """One track: its data set, population and evaluation."""

    name: str
    dataset: str  # the Hub data set, the templates' static dataset.name
    num_supernodes: int
    fraction_train: float  # the template's default
    evaluation: str  # what the leaderboard scores
    eval_command: str  # its evaluation, {base} and {peft} to fill in

    @property
    def template(self) -> str:
        return f"examples/flowertune-llm-{self.name}/pyproject.toml"

    @property
    def eval_dir(self) -> str:
        return f"benchmarks/flowertune-llm/evaluation/{self.name}"


_EVAL = "python eval.py --base-model-name-path={base} --peft-path={peft} --run-name=fl"
TRACKS: dict[str, Track] = {
    t.name: t
    for t in (
        Track(
            "general-nlp", "flwrlabs/alpaca-gpt4", 20, 0.1,
            "MMLU: STEM, social sciences, humanities",
            f"{_EVAL} --batch-size=16 --quantization=4 "
            "--category=stem,social_sciences,humanities",
        ),
        Track(
            "finance", "flwrlabs/fingpt-sentiment-train", 50, 0.1, "FPB, FIQA, TFNS",
            f"{_EVAL} --batch-size=32 --quantization=4 --datasets=fpb,fiqa,tfns",
        ),
        Track(
            "medical", "flwrlabs/medical-meadow-medical-flashcards", 20, 0.1,
            "PubMedQA, MedMCQA, MedQA, CareQA",
            f"{_EVAL} --batch-size=16 --quantization=4 "
            "--datasets=pubmedqa,medmcqa,medqa,careqa",
        ),
        Track(
            "code", "flwrlabs/code-alpaca-20k", 10, 0.2,
            "MBPP, HumanEval, MultiPL-E (JavaScript, C++)",
            "python main.py --model={base} --peft_model={peft} --max_length_generation=1024 "
            "--batch_size=4 --use_auth_token --allow_code_execution --save_generations "
            "--save_references --tasks=humaneval "
            "--metric_output_path=./evaluation_results_humaneval.json "
            "(and --tasks mbpp with --max_length_generation=2048, multiple-js, multiple-cpp)",
        ),
    )
}  # fmt: skip


def static_values(track: Track) -> dict[str, Any]:
    """The settings a run on ``track`` may not change (module docstring), with their values."""
    return {
        "task": track.dataset,
        "data-path": "",
        "task-kind": "causal-lm",
        "partitioner": "iid",
        "max-train-examples": 0,
    }


STATIC_KEYS = tuple(static_values(next(iter(TRACKS.values()))))


def get_track(config: RunConfig) -> Track | None:
    """The run's track, None when it is entered in none."""
    return TRACKS.get(config.flowertune_track) if config.flowertune_track else None


def _refuse(track: Track, rule: str, detail: str) -> ConfigError:
    return ConfigError(f"leaderboard ({track.name}, rule '{rule}'): {detail}; {LIFT}")


def check_static(config: RunConfig, track: Track) -> None:
    """Every static setting at the track's value."""
    changed = {
        key: (getattr(config, key.replace("-", "_")), value)
        for key, value in static_values(track).items()
        if getattr(config, key.replace("-", "_")) != value
    }
    if changed:
        what = ", ".join(
            f"{k}={have!r} (the track fixes {want!r})" for k, (have, want) in changed.items()
        )
        raise _refuse(track, "static config", f"the static settings may not change: {what}")


def check_method(config: RunConfig, track: Track) -> None:
    """A method with one global model that is a PEFT adapter on the unchanged base."""
    method = get_method(config.method)
    if method.personal:
        raise _refuse(
            track, "one global PEFT checkpoint",
            f"method={config.method!r} keeps personal parts ({', '.join(method.local)}) on "
            "its clients, so its global model is not the model it trains",
        )  # fmt: skip
    if method.writes_base_weights:
        raise _refuse(
            track, "one global PEFT checkpoint",
            f"method={config.method!r} writes into the base weights, which the evaluation "
            "loads unchanged",
        )  # fmt: skip


def check_supernodes(track: Track, num_supernodes: int | None, connection: str) -> None:
    """The connection simulates the track's number of SuperNodes."""
    if num_supernodes is None:
        raise _refuse(
            track, "SuperNodes",
            f"the connection {connection!r} does not say how many SuperNodes it simulates "
            f"(options.num-supernodes); the track needs {track.num_supernodes} "
            f"(florg flwr-home setup --num-supernodes {track.num_supernodes})",
        )  # fmt: skip
    if num_supernodes != track.num_supernodes:
        raise _refuse(
            track, "SuperNodes",
            f"the connection {connection!r} simulates {num_supernodes} SuperNodes, the track "
            f"needs {track.num_supernodes} (florg flwr-home setup --num-supernodes "
            f"{track.num_supernodes})",
        )  # fmt: skip


def check_budget(track: Track, method: str, projected_mb: float) -> None:
    """The projected communication of the whole run within the budget."""
    if projected_mb > BUDGET_MB:
        raise _refuse(
            track, "communication budget",
            f"method={method!r} is projected to communicate {projected_mb:,.0f} MB over the "
            f"run, above the budget of {BUDGET_MB:,.0f} MB",
        )  # fmt: skip


def megabytes(params: int | float, bytes_per_param: int = 4) -> float:
    """Parameters that travel as float32, in the templates' MB."""
    return float(params) * bytes_per_param / BYTES_PER_MB
