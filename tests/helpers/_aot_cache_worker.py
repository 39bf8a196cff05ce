"""One process of tests/unit/accel/test_drafter_compile.py's warm-start test: a small FP8 drafter's compiled layers through
inductor on the CPU, one forward and backward under bf16 autocast, with the compile cache in argv[1]. Saves the
output and the gradients to argv[2] and prints the compile caches' counters as JSON. An optional argv[3] makes it
a precompile child of tests/benchmarks/test_precompile.py: only the compiled functions named like one of its comma-separated
parts compile (`compile.restrict_to`); the line then also carries the graphs it compiled. Not a test module."""

import json
import sys

import torch
from transformers import Qwen3Config

from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.accel import compile as compile_layer
from dflash_train.accel.fp8_training import use_fp8_training

H, BS = 64, 4


def main(cache_dir: str, out_path: str, only: str = "") -> None:
    compile_layer.configure_cache(cache_dir)
    if only:
        compile_layer.restrict_to(tuple(only.split(",")))
    tcfg = Qwen3Config(hidden_size=H, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1000)
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(tcfg, num_draft_layers=2, block_size=BS, target_layer_ids=[1, 5],
                                                mask_token_id=3))
    use_fp8_training(drafter)
    drafter.compile_layers(backend="inductor")
    b, s, n = 2, 32, 4
    g = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(b, s, 2 * H, generator=g), torch.randn(b, n * BS, H, generator=g)
    anchors = torch.stack([torch.randperm(s - BS, generator=g)[:n].sort().values for _ in range(b)])
    positions = torch.cat([torch.arange(s).expand(b, s), (anchors.unsqueeze(-1) + torch.arange(BS)).view(b, -1)], 1)
    mask = dense_mask(anchors, torch.ones(b, n, dtype=torch.bool), s, BS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(hidden, embeds, positions, sdpa_attention, mask, compiled_layers=True)
    out.float().pow(2).mean().backward()
    torch.save({"out": out.detach(), **{n: p.grad for n, p in drafter.named_parameters()}}, out_path)
    print(json.dumps({**compile_layer.cache_stats(), "graphs": compile_layer.graphs_compiled()}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
