"""The benchmarks, one subpackage per subject; run each from the repository root as a
module, e.g. ``python -m benchmarks.core.core_benchmark --quick``.

``core``: the FLoRG server step and a client training step (``core_benchmark``), and
FLoRG vs LoRA on decoders in fp32 / bf16 with gradient checkpointing (``decoder_benchmark``),
and one example-level DP-SGD step of FLoRG vs LoRA (``dp_sgd_step``).
``overhead``: the Flower simulation and a SuperLink deployment against a plain loop of the
same work (``simulation_overhead``, ``deployment_overhead``).
``scale``: N SuperNodes and K clients per round through the simulation: round time, a
client's training against everything else, aggregation, peak memory (``scale_benchmark``).
``centralised``: one process training on the whole training split -- the seeded
centralised reference (``centralised_reference``), protocol v2's head learning rate
(``head_learning_rate``) and how far the adapters move the weights (``adapter_growth``).
``evidence``: the evidence grids' client partitions against their per-seed scores
(``partition_skew``).
``faults``: one poisoning client, with and without update screening (``poisoning``).

Numbers and where they are published: ``docs/benchmarks.md``.
"""

from pathlib import Path

# the benchmarks resolve run configs and build methods: every method registers first
import strategies.registry  # noqa: F401, E402

REPO_ROOT = Path(__file__).resolve().parents[1]
