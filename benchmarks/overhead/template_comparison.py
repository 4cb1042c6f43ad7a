"""This app against Flower's own LLM template on the same small job, side by side in one run.

The template is flwrlabs' ``flowertune-llm`` example (FedAvg with PEFT LoRA through TRL's
SFTTrainer), checked out outside this repository and run as it is, from an environment of
its own (``--template-python``: an interpreter with its pinned trl, peft and transformers;
its code is never copied here). This app runs FedIT on the same job: the same base model,
Alpaca-format rows, clients, rounds, local steps, batch, sequence length, LoRA rank and
alpha on the template's target modules (PEFT's default for the architecture: q_proj and
v_proj for Llama-like models) and learning rate (the template's cosine from
``learning-rate-max`` to ``learning-rate-min``: both set to the rate, a constant).

Each side gets a private SuperLink of its own environment with N simulated SuperNodes; the
benchmark timestamps the rounds in the run's streamed log, samples the memory (RSS) of every
process the SuperLink started, and reads the last aggregated training loss. It prints each
side's seconds per round, peak memory and final training loss, and the ratios app /
template; the bytes per round are this app's measured ``uplink-bytes`` + ``downlink-bytes``,
and the template's LoRA arrays counted at 4 bytes an entry (the same shapes).

The template's ``get_model`` accepts only a 4-bit or 8-bit base (bitsandbytes), so it runs
with ``model.quantization=4``: bitsandbytes' CPU path, its base in bitsandbytes' default
4-bit (FP4), while this app
refuses quantization without CUDA and runs its base in float32. The ratios compare the two
apps as each runs this job on a CPU, not equal numerics.

    python -m benchmarks.overhead.template_comparison --template DIR --template-python PY \
        [--model PATH] [--rows FILE] [--clients 2] [--rounds 2] [--steps 4] ...
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
LOSS = re.compile(r"'train[_-]loss': ([-+0-9.eE]+)")
FINISHED = re.compile(r"Strategy execution finished|Run finished")


@dataclass
class Side:
    """One app's run: round start times on this clock, its end, peak memory, last loss."""

    name: str
    round_starts: dict[int, float] = field(default_factory=dict)
    end: float | None = None
    peak_rss: int = 0
    train_loss: float | None = None
    log: list[str] = field(default_factory=list)

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
            self.train_loss = float(loss.group(1))
        if FINISHED.search(line) and self.end is None:
            self.end = now


def tree_rss(tag: str) -> int:
    """Bytes resident in every process carrying ``tag`` (the SuperLink's and all it
    started)."""
    import psutil

    from florg_tools.processes import tagged_processes

    total = 0
    for info in tagged_processes(tag):
        try:
            total += psutil.Process(info.pid).memory_info().rss
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
                side.peak_rss = max(side.peak_rss, tree_rss(tag))

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


def job_settings(args: argparse.Namespace, data_dir: Path) -> tuple[dict, dict]:
    """(the template's run config, this app's) for the same job."""
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


def ratio_lines(ours: Side, template: Side, bytes_ours: float, bytes_template: float) -> list[str]:
    """The printed comparison: each side's figures and app / template."""

    def row(what: str, a: float, b: float, fmt: Callable[[float], str]) -> str:
        return f"{what:<24}{fmt(a):>14}{fmt(b):>14}{a / b:>10.2f}x"

    def mb(x: float) -> str:
        return f"{x / 2**20:,.1f} MB"

    lines = [f"{'':<24}{'this app':>14}{'template':>14}{'ratio':>11}"]
    lines.append(
        row(
            "seconds per round",
            ours.seconds_per_round(),
            template.seconds_per_round(),
            lambda x: f"{x:.1f} s",
        )
    )
    lines.append(row("peak memory (RSS)", ours.peak_rss, template.peak_rss, mb))
    lines.append(row("bytes per round", bytes_ours, bytes_template, mb))
    if ours.train_loss is not None and template.train_loss is not None:
        lines.append(
            row("final training loss", ours.train_loss, template.train_loss, lambda x: f"{x:.4f}")
        )
    else:  # say which side's log held none
        found = {side.name: side.train_loss for side in (ours, template)}
        lines.append(f"{'final training loss':<24}not read: {found}")
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


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    from florg_tools.app_stage import stage_app
    from flower_app.paths import OUTPUT_ROOT_ENV

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
        template_config, our_config = job_settings(args, data_dir)
        template = run_side(
            Side("template"),
            args.template_python.parent,
            args.template,
            template_config,
            work,
            args.clients,
            args.timeout,
        )
        app = stage_app(ROOT, work / "app")  # the files its FAB holds (florg_tools.app_stage)
        ours = run_side(
            Side("app"),
            Path(sys.executable).parent,
            app,
            our_config,
            work,
            args.clients,
            args.timeout,
            {OUTPUT_ROOT_ENV: str(work)},
        )
        rows = [
            json.loads(line)
            for line in (work / "outputs" / "template-comparison" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        measured = [r["uplink-bytes"] + r["downlink-bytes"] for r in rows if r["round"] >= 1]
        ours.train_loss = rows[-1].get("train-loss", ours.train_loss)  # its console omits it
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for side in (template, ours):
                (args.keep_logs / f"{side.name}.log").write_text("\n".join(side.log))
        bytes_ours = sum(measured) / len(measured)
        bytes_template = lora_bytes_per_round(args.model, args.rank, args.clients)
        print(
            f"job: {args.model.name}, {args.rows.name}, {args.clients} clients, {args.rounds} "
            f"rounds of {args.steps} steps of batch {args.batch}, r = {args.rank}, "
            f"lr {args.lr:g}, sequences of {args.seq_length}; the template's base 4-bit "
            f"(its get_model accepts no other), this app's float32"
        )
        print("\n".join(ratio_lines(ours, template, bytes_ours, bytes_template)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
