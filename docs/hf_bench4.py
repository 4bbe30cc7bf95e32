"""bench4 in HF transformers, the peer figure beside `dsv4 bench` (docs/perf.md): eager, BF16,
with its KV cache; prefill 1024 random tokens, then time 32 greedy decode steps on the GPU.
Flash widths (the config's defaults), 4 layers [HCA, HCA, HCA, CSA], learned routing in every
layer, weights drawn from N(0, 0.02²). Needs transformers 5.17.0 and ~55 GB of GPU memory:

    python3 docs/hf_bench4.py
"""
import sys
import time

import torch
import transformers
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"
PROMPT, DECODE, WARMUP = 1024, 32, 3

config = DeepseekV4Config(
    num_hidden_layers=4,
    layer_types=[HCA, HCA, HCA, CSA],
    mlp_layer_types=["moe"] * 4,
    attn_implementation="eager",
)
torch.manual_seed(0)
t0 = time.perf_counter()
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = mdv4.DeepseekV4ForCausalLM(config).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.02)
torch.cuda.synchronize()
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
print(f"model built in {time.perf_counter() - t0:.1f} s: {params / 1e9:.2f} GB of parameters")
ids = torch.randint(0, config.vocab_size, (1, PROMPT), device="cuda")
with torch.no_grad():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model(ids, use_cache=True)
    torch.cuda.synchronize()
    print(f"prefill: {PROMPT} tokens in {time.perf_counter() - t0:.3f} s")
    past = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    for i in range(WARMUP + DECODE):
        if i == WARMUP:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        out = model(tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / DECODE
print(f"decode: {ms:.2f} ms/token over {DECODE} steps (eager, BF16, KV cache)")
sys.stdout.flush()
