"""This app against Flower's own LLM template on the same small job, side by side in one run.

The template is flwrlabs' ``flowertune-llm`` example (FedAvg with PEFT LoRA through TRL's
SFTTrainer), checked out outside this repository and run from an environment of its own
(``--template-python``: an interpreter with its pinned trl, peft and transformers; its code
is never copied here). This app runs FedIT on the same job: the same base model,
Alpaca-format rows in the template's prompt, clients, rounds, local steps, batch, sequence
length, LoRA rank and alpha on the template's target modules (PEFT's default for the
architecture: q_proj and v_proj for Llama-like models) and learning rate (the template's
cosine from ``learning-rate-max`` to ``learning-rate-min``: both set to the rate, a constant).

Equal precision (``--template-base float32``, the default): the template's ``get_model``
accepts only a 4-bit or 8-bit base, so the benchmark patches it at run time
(``template_patch/sitecustomize.py`` on the template's PYTHONPATH): its base loads in
float32 as this app's, its LoRA dropout is 0 as this app's, and its Trainer's seed is the
repetition's. ``--template-base 4bit`` runs it as it ships (bitsandbytes' 4-bit; on a CPU
its slow path) beside this app's float32.

Each side gets a private SuperLink of its own environment with N simulated SuperNodes, once
per repetition (seeds 0..R-1, the sides alternating which runs first); the benchmark
timestamps the rounds in the run's streamed log, samples the memory (RSS) of every process
the SuperLink started, and reads each round's aggregated training loss. It prints each
side's seconds per round, peak memory and bytes per round with 95% t intervals over the
repetitions, the ratios app / template (paired by repetition), and the training loss at
each round (equal steps) with the paired difference. The bytes are this app's measured
``uplink-bytes`` + ``downlink-bytes`` and the template's LoRA arrays counted at 4 bytes an
entry (the same shapes).

    python -m benchmarks.overhead.template_comparison --template DIR --template-python PY \
        [--template-base float32|4bit] [--repeats 3] [--model PATH] [--rows FILE] \
        [--clients 2] [--rounds 2] [--steps 4] ...
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUND_LINE = re.compile(r"\[ROUND (\d+)/(\d+)\]")
RECEIVED = re.compile(r"aggregate_train: Received (\d+) results and (\d+) failures")
LOSS = re.compile(r"Aggregated MetricRecord: .*'train[_-]loss': ([-+0-9.eE]+)")  # not a client's
FINISHED = re.compile(r"Strategy execution finished|Run finished")


@dataclass
class Side:
    """One app's run: round start times on this clock, its end, peak memory, each round's
    aggregated training loss."""

    name: str
    round_starts: dict[int, float] = field(default_factory=dict)
    end: float | None = None
    peak_rss: int = 0  # the tree's, at its peak
    peak_by_role: dict[str, int] = field(default_factory=dict)  # each role's own peak
    train_losses: list[float] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    @property
    def train_loss(self) -> float | None:
        """The last round's aggregated training loss (None before one is read)."""
        return self.train_losses[-1] if self.train_losses else None

    def seconds_per_round(self) -> float:
        """Mean of each round's time, from its start to the next one's (the last: to the
        strategy's end)."""
        rounds = sorted(self.round_starts)
        if not rounds or self.end is None:
            raise ValueError(f"{self.name}: no complete round in its log")
        edges = [self.round_starts[r] for r in rounds] + [self.end]
        return (edges[-1] - edges[0]) / len(rounds)

    failures: int = 0  # failed training replies (Flower's aggregate_train line)

    def read(self, line: str, now: float) -> None:
        """One line of the streamed log."""
        self.log.append(line)
        received = RECEIVED.search(line)
        if received:
            self.failures += int(received.group(2))
        found = ROUND_LINE.search(line)
        if found:
            self.round_starts.setdefault(int(found.group(1)), now)
        loss = LOSS.search(line)
        if loss:
            self.train_losses.append(float(loss.group(1)))
        if FINISHED.search(line) and self.end is None:
            self.end = now


ROLES = ("ServerApp", "ClientApps", "Flower and Ray")  # the memory table's rows


def process_role(cmdline: str) -> str:
    """Which part of a run a process of its tree is: the ServerApp (Flower's simulation
    process, which runs it), a ClientApp (a Ray actor of the simulation), or the rest
    (SuperLink, SuperExec, ``flwr``, Ray's services)."""
    if "flwr-simulation" in cmdline:
        return "ServerApp"
    if "ClientAppActor" in cmdline:
        return "ClientApps"
    return "Flower and Ray"


def tree_rss(tag: str) -> dict[str, int]:
    """Bytes resident in every process carrying ``tag`` (the SuperLink's and all it
    started), summed by ``process_role``."""
    import psutil

    from florg_tools.processes import tagged_processes

    total = dict.fromkeys(ROLES, 0)
    for info in tagged_processes(tag):
        try:
            total[process_role(info.cmdline)] += psutil.Process(info.pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def run_side(
    side: Side,
    bin_dir: Path,
    app: Path,
    run_config: dict[str, object],
    work: Path,
    clients: int,
    timeout: float,
    extra_env: dict[str, str] | None = None,
) -> Side:
    """``flwr run APP`` against a private SuperLink started from ``bin_dir``'s Flower, with
    ``clients`` simulated SuperNodes (one CPU each)."""
    from florg_tools.flwr_cli import flwr_env
    from florg_tools.flwr_home import write_local_simulation_connection
    from florg_tools.processes import TrackedProcess, spawn
    from florg_tools.superlink import find_free_port, wait_healthy

    home = work / side.name / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    port = find_free_port()
    env = flwr_env(
        home,
        extra={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            **(extra_env or {}),
        },
    )
    popen, tag = spawn(
        [
            str(bin_dir / "flower-superlink"),
            "--insecure",
            "--simulation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        env=env,
        log_path=work / side.name / "superlink.log",
        cwd=work / side.name,
    )
    superlink = TrackedProcess(popen, tag, work / side.name / "superlink.log")
    superlink.start_tracking()
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", exit_code=popen.poll, timeout=60)
        write_local_simulation_connection(
            home,
            "bench",
            num_supernodes=clients,
            num_cpus_per_client=1,
            num_gpus_per_client=0.0,
            address=f"127.0.0.1:{port}",
            set_default=True,
        )
        overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in run_config.items())
        command = [
            str(bin_dir / "flwr"),
            "run",
            str(app),
            "bench",
            "--stream",
            "--run-config",
            overrides,
        ]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                now = tree_rss(tag)
                side.peak_rss = max(side.peak_rss, sum(now.values()))
                for role, rss in now.items():
                    side.peak_by_role[role] = max(side.peak_by_role.get(role, 0), rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=work / side.name,
        )
        try:
            finished = read_until(process, lambda line: side.read(line, time.monotonic()), timeout)
        finally:
            stop.set()
            sampler.join()
        if not finished:
            raise TimeoutError(f"{side.name}: still running after {timeout:.0f} s")
        if side.failures:  # rounds of failed clients time nothing worth comparing
            errors = [line for line in side.log if "Error" in line or "Exception" in line]
            raise RuntimeError(
                f"{side.name}: {side.failures} training replies failed; first errors:\n"
                + "\n".join(errors[:5])
            )
        if side.end is None:  # Flower's --stream exits 0 on a failed run: its log says
            tail = "\n".join(side.log[-40:])
            raise RuntimeError(f"{side.name}: the run did not finish; its log ends:\n{tail}")
    finally:
        superlink.stop()
    return side


def read_until(
    process: subprocess.Popen[str], on_line: Callable[[str], None], timeout: float
) -> bool:
    """Each line ``process`` prints to ``on_line`` until it exits (True), or until
    ``timeout`` seconds have passed, when it is killed (False). A timer, not a check per
    line: a run that hangs without printing is stopped too."""
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        process.kill()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    assert process.stdout is not None
    try:
        for line in process.stdout:
            on_line(line.rstrip("\n"))
        process.wait()
    finally:
        timer.cancel()
    return not timed_out.is_set()


def model_for_template(model: Path, dest: Path) -> Path:
    """``model`` as the template's transformers (4.53) reads it: a tokenizer saved by
    transformers 5 names its class ``TokenizersBackend``, which 4.53 does not know; the copy
    names the fast tokenizer its ``tokenizer.json`` already is. Weights and config are
    linked, not copied."""
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("tokenizer_class") != "TokenizersBackend":
        return model
    dest.mkdir(parents=True)
    for item in model.iterdir():
        if item.name != "tokenizer_config.json":
            (dest / item.name).symlink_to(item.resolve())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dest


PATCH_DIR = Path(__file__).resolve().parent / "template_patch"  # its sitecustomize.py


def template_env(base: str, seed: int, marker: Path) -> dict[str, str]:
    """The template side's environment: the run-time patch on its PYTHONPATH (imported by
    every process its SuperLink starts), the base's precision, the seed and the file the
    patch reports to."""
    return {
        "PYTHONPATH": str(PATCH_DIR),
        "TEMPLATE_COMPARISON_BASE": base,
        "TEMPLATE_COMPARISON_SEED": str(seed),
        "TEMPLATE_COMPARISON_MARKER": str(marker),
    }


def check_template_patch(marker: Path, base: str, seed: int) -> None:
    """Refuse a template run the patch did not reach: every training at ``seed``, and with
    a float32 base every base load float32 and unquantised."""
    events = (
        [json.loads(line) for line in marker.read_text().splitlines()] if marker.is_file() else []
    )
    seeds = {e["seed"] for e in events if e["event"] == "seed"}
    if seeds != {seed}:
        raise RuntimeError(
            f"the template's Trainer seeds were {sorted(seeds)}, not [{seed}]: the run-time "
            f"patch ({PATCH_DIR / 'sitecustomize.py'}) did not reach its ClientApp"
        )
    if base != "float32":
        return
    loads = [e for e in events if e["event"] == "base"]
    wrong = [e for e in loads if e["dtype"] != "torch.float32" or e["quantized"]]
    if not loads or wrong:
        raise RuntimeError(
            f"the template's base was not loaded in float32 unquantised ({len(loads)} loads, "
            f"these not: {wrong[:3]}): the run-time patch did not reach its get_model"
        )


def job_settings(args: argparse.Namespace, data_dir: Path, seed: int) -> tuple[dict, dict]:
    """(the template's run config, this app's) for the same job at ``seed`` (the template's
    seed travels in its environment: ``template_env``)."""
    template = {
        "dataset.name": str(data_dir),
        "model.name": str(args.template_model),
        "model.quantization": 4,
        "model.gradient-checkpointing": False,
        "model.lora.peft-lora-r": args.rank,
        "model.lora.peft-lora-alpha": 2 * args.rank,
        "train.seq-length": args.seq_length,
        "train.learning-rate-max": args.lr,
        "train.learning-rate-min": args.lr,
        "train.save-every-round": args.rounds + 1,
        "train.training-arguments.per-device-train-batch-size": args.batch,
        "train.training-arguments.max-steps": args.steps,
        "train.training-arguments.gradient-checkpointing": False,
        "train.training-arguments.logging-steps": 1,
        "strategy.fraction-train": 1.0,
        "num-server-rounds": args.rounds,
    }
    ours = {  # conf/flowertune-general-nlp.toml's task on local rows, as the rehearsal's
        "method": "fedit",
        "seed": seed,
        "task": "flwrlabs/alpaca-gpt4",
        "task-kind": "causal-lm",
        "text-fields": "instruction",
        "prompt-format": "flowertune",
        "partitioner": "iid",
        "max-train-examples": 0,
        "client-eval": "off",
        "model": str(args.model),
        "data-path": str(args.rows),
        "target-modules": "q_proj,v_proj",
        "rank": args.rank,
        "alpha": float(2 * args.rank),
        "learning-rate": args.lr,
        "head-learning-rate": args.lr,
        "local-steps": args.steps,
        "batch-size": args.batch,
        "max-seq-length": args.seq_length,
        "num-server-rounds": args.rounds,
        "min-train-nodes": args.clients,
        "min-available-nodes": args.clients,
        "fraction-train": 1.0,
        "max-eval-examples": 8,
        "max-test-examples": 0,
        "output-dir": "outputs",  # under $FLORG_OUTPUT_ROOT, the work folder
        "run-name": "template-comparison",
        "progress-bar": False,
    }
    return template, ours


@dataclass
class Repetition:
    """One repetition's pair of runs at one seed, and each side's bytes per round."""

    seed: int
    ours: Side
    template: Side
    bytes_ours: float
    bytes_template: float


def _interval(values: Sequence[float], number: str, unit: str = "") -> str:
    """``mean ± half-width`` of the 95% t interval of ``values`` (the mean alone for one
    value), each formatted with ``number`` (a format spec) and followed by ``unit``."""
    from florg_lab.stats import mean_interval

    found = mean_interval(values)
    if found.n < 2:
        return f"{found.mean:{number}}{unit}"
    half = f"{(found.high - found.low) / 2:{number.lstrip('+')}}"  # no sign on a half-width
    return f"{found.mean:{number}} ± {half}{unit}"


def comparison_lines(reps: Sequence[Repetition]) -> list[str]:
    """The printed comparison over the repetitions: each side's mean and 95% t interval,
    app / template paired by repetition, and the training loss at each round with the
    paired difference app − template."""

    def row(what: str, ours: list[float], template: list[float], number: str, unit: str) -> str:
        ratio = "–"  # a part the template's tree never showed has no ratio
        if all(template):
            ratio = _interval([a / b for a, b in zip(ours, template, strict=True)], ".2f", "x")
        return (
            f"{what:<22}{_interval(ours, number, unit):>26}{_interval(template, number, unit):>26}"
            f"{ratio:>18}"
        )

    mb = 2**20
    lines = [f"{'':<22}{'this app':>26}{'template':>26}{'app / template':>18}"]
    lines.append(row("seconds per round", [r.ours.seconds_per_round() for r in reps],
                     [r.template.seconds_per_round() for r in reps], ".1f", " s"))  # fmt: skip
    lines.append(row("peak memory (RSS)", [r.ours.peak_rss / mb for r in reps],
                     [r.template.peak_rss / mb for r in reps], ",.1f", " MB"))  # fmt: skip
    for role in ROLES:  # each role's own peak (the peaks need not coincide)
        lines.append(row(f"  {role}", [r.ours.peak_by_role.get(role, 0) / mb for r in reps],
                         [r.template.peak_by_role.get(role, 0) / mb for r in reps],
                         ",.1f", " MB"))  # fmt: skip
    lines.append(row("bytes per round", [r.bytes_ours / mb for r in reps],
                     [r.bytes_template / mb for r in reps], ",.2f", " MB"))  # fmt: skip
    rounds = {len(r.ours.train_losses) for r in reps} | {len(r.template.train_losses) for r in reps}
    if len(rounds) != 1 or 0 in rounds:  # say which side's log held what
        found = {r.seed: (r.ours.train_losses, r.template.train_losses) for r in reps}
        return [*lines, f"{'training loss':<22}not read alike (seed: app, template): {found}"]
    lines.append(f"{'training loss':<22}{'this app':>26}{'template':>26}{'app - template':>18}")
    for i in range(rounds.pop()):
        ours = [r.ours.train_losses[i] for r in reps]
        template = [r.template.train_losses[i] for r in reps]
        difference = [a - b for a, b in zip(ours, template, strict=True)]
        lines.append(
            f"{f'  round {i + 1}':<22}{_interval(ours, '.4f'):>26}"
            f"{_interval(template, '.4f'):>26}{_interval(difference, '+.4f'):>18}"
        )
    return lines


def lora_bytes_per_round(model: Path, rank: int, clients: int) -> float:
    """The template's LoRA arrays (q_proj and v_proj at ``rank``) down and up for every
    client, 4 bytes an entry."""
    import strategies.registry  # noqa: F401
    from florg_tools.comm_projection import adapted_layer_shapes
    from flower_app.settings.config import resolve_config

    config = resolve_config(
        {
            "model": str(model),
            "target-modules": "q_proj,v_proj",
            "task-kind": "causal-lm",
            "rank": rank,
        }
    )
    shapes = adapted_layer_shapes(config, "causal-lm")
    params = sum(rank * (o + i) for o, i in shapes.values())
    return float(2 * 4 * params * clients)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--template",
        type=Path,
        required=True,
        help="the flowertune-llm example's folder (a checkout of flwrlabs/flower)",
    )
    parser.add_argument(
        "--template-python",
        type=Path,
        required=True,
        help="an interpreter with the template's dependencies",
    )
    parser.add_argument(
        "--model", type=Path, default=Path("~/.cache/florg/models/SmolLM2-135M").expanduser()
    )
    parser.add_argument("--rows", type=Path, default=ROOT / "scripts/data/alpaca-rehearsal.jsonl")
    parser.add_argument(
        "--template-base",
        choices=("float32", "4bit"),
        default="float32",
        help="the template's base: float32 as this app's (patched at run time; the default) "
        "or 4-bit as it ships",
    )
    parser.add_argument("--repeats", type=int, default=3, help="repetitions, seeds 0..R-1")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seq-length", type=int, default=96)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument(
        "--keep-logs", type=Path, default=None, help="write each side's streamed log here"
    )
    return parser.parse_args(argv)


def run_repetition(
    args: argparse.Namespace,
    seed: int,
    app: Path,
    data_dir: Path,
    rep_dir: Path,
    bytes_template: float,
) -> Repetition:
    """Both sides at ``seed`` in ``rep_dir`` (``bytes_template``: the template's bytes per
    round, computed); the template first at even seeds, this app
    first at odd ones (a drift in the machine's speed falls on both alike)."""
    import sys

    from flower_app.paths import OUTPUT_ROOT_ENV

    template_config, our_config = job_settings(args, data_dir, seed)
    marker = rep_dir / "template-patch.jsonl"

    def run_template() -> Side:
        side = run_side(Side("template"), args.template_python.parent, args.template,
                        template_config, rep_dir, args.clients, args.timeout,
                        template_env(args.template_base, seed, marker))  # fmt: skip
        check_template_patch(marker, args.template_base, seed)
        return side

    def run_ours() -> Side:
        return run_side(Side("app"), Path(sys.executable).parent, app, our_config, rep_dir,
                        args.clients, args.timeout, {OUTPUT_ROOT_ENV: str(rep_dir)})  # fmt: skip

    if seed % 2 == 0:
        template, ours = run_template(), run_ours()
    else:
        ours = run_ours()
        template = run_template()
    metrics = rep_dir / "outputs" / "template-comparison" / "metrics.jsonl"
    rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
    rounds = [r for r in rounds if r["round"] >= 1]
    ours.train_losses = [float(r["train-loss"]) for r in rounds]  # its console omits them
    measured = [r["uplink-bytes"] + r["downlink-bytes"] for r in rounds]
    print(f"seed {seed}: app {ours.seconds_per_round():.1f} s/round, template "
          f"{template.seconds_per_round():.1f} s/round", flush=True)  # fmt: skip
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        for side in (template, ours):
            (args.keep_logs / f"{side.name}-seed{seed}.log").write_text("\n".join(side.log))
    return Repetition(seed, ours, template, sum(measured) / len(measured), bytes_template)


def main(argv: Sequence[str] | None = None) -> int:
    from florg_tools.app_stage import stage_app

    args = parse_args(argv)
    if not (args.template / "pyproject.toml").is_file():
        raise SystemExit(
            f"--template: {args.template} holds no pyproject.toml (the example's folder)"
        )
    work = Path(tempfile.mkdtemp(prefix="template-comparison-"))
    try:
        data_dir = work / "alpaca"
        data_dir.mkdir()
        shutil.copy(args.rows, data_dir / "train.jsonl")  # the template's load_dataset(folder)
        args.template_model = model_for_template(args.model, work / "template-model")
        app = stage_app(ROOT, work / "app")  # the files its FAB holds (florg_tools.app_stage)
        bytes_template = lora_bytes_per_round(args.model, args.rank, args.clients)
        reps = [
            run_repetition(args, seed, app, data_dir, work / f"seed-{seed}", bytes_template)
            for seed in range(args.repeats)
        ]
        base = (
            "float32 (patched at run time: no quantization, LoRA dropout 0)"
            if args.template_base == "float32"
            else "4-bit, as it ships (bitsandbytes)"
        )
        print(
            f"job: {args.model.name}, {args.rows.name}, {args.clients} clients, {args.rounds} "
            f"rounds of {args.steps} steps of batch {args.batch}, r = {args.rank}, "
            f"lr {args.lr:g}, sequences of {args.seq_length}; {args.repeats} repetitions "
            f"(seeds 0..{args.repeats - 1}), 95% t intervals; the template's base {base}, "
            f"this app's float32"
        )
        print("\n".join(comparison_lines(reps)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
