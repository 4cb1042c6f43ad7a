"""The core benchmark (``python -m benchmarks.core.core_benchmark``): ``settings`` (sizes
and shapes), ``server`` (the server-step workers), ``client`` (the client-step and memory
workers) and ``report`` (the tables); the decoder benchmark
(``python -m benchmarks.core.decoder_benchmark``, one module: FLoRG vs PEFT LoRA step time
and peak memory on decoders in fp32 / bf16 with gradient checkpointing); every registered
method's server round side by side with FLoRG's (``python -m benchmarks.core.server_methods``);
and the DP-SGD step benchmark (``python -m benchmarks.core.dp_sgd_step``: one example-level
DP-SGD step of FLoRG vs PEFT LoRA under Opacus, with both without DP)."""
