"""Tiny random mixture-of-experts targets (Qwen3-MoE, Qwen3.5-MoE), saved as HF checkpoints."""

import torch

VOCAB = 1000
MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB)


def qwen3_moe(**over):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Every layer sparse except layer 1 (a dense MLP): both kinds of decoder layer appear.
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE, "decoder_sparse_step": 1, "mlp_only_layers": [1], **over}))


def qwen3_5_moe():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(MOE, shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16,
                layer_types=["linear_attention", "full_attention"] * 2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))


def save(build, path, seed=0):
    torch.manual_seed(seed)
    model = build().eval()
    # Random routers (HF initialises them to zero: every token would pick the same experts).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path
