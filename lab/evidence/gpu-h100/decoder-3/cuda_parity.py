"""On CUDA under bf16 autocast: FLoRG's layer vs PEFT LoRA's holding the same factors
(the twins of tests/runtime/test_precision.py), output bitwise and A's gradient by the chain rule.

Ran on the device (call 2) as ``PYTHONPATH=. python3 .devjob/cuda_parity.py``; this is that
file, ruff-formatted since. From the repository root:
``PYTHONPATH=. python3 lab/evidence/gpu-h100/decoder-3/cuda_parity.py`` (needs CUDA)."""

import json

import torch

from flower_app.training.precision import MixedPrecision
from tests.runtime.test_precision import _florg_and_peft_twins

f_layer, l_layer = _florg_and_peft_twins()
f_layer.cuda()
l_layer.cuda()
x = torch.randn(4, 64, 32, device="cuda").bfloat16()
G = torch.randn(4, 64, 32, device="cuda")
ys = []
for layer in (f_layer, l_layer):
    layer.train()
    with MixedPrecision.for_run("bf16", "cuda").autocast():
        y = layer(x)
    (y.float() * G).sum().backward()
    ys.append(y)
gl, gr = l_layer.lora_B["default"].weight.grad, l_layer.lora_A["default"].weight.grad
chain = gl.T @ f_layer.L + gr @ f_layer.R.T
rel = float(torch.linalg.norm(f_layer.A.grad - chain) / torch.linalg.norm(chain))
print(
    json.dumps(
        {
            "device": torch.cuda.get_device_name(0),
            "dtype": str(ys[0].dtype),
            "outputs_bitwise_equal": bool(torch.equal(ys[0], ys[1])),
            "max_abs_output_diff": float((ys[0].float() - ys[1].float()).abs().max()),
            "grad_A_rel_diff_to_chain_rule": rel,
        }
    )
)
