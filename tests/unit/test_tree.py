"""vLLM's module tree from a config alone, on the meta device: models far too large to load."""

import json
import time

import pytest

from vlens import weightless_model

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


@pytest.mark.parametrize(
    ("config", "billions", "paths"),
    [
        (QWEN3_8B, 8.19, ["model.layers.35.self_attn.qkv_proj", "model.layers.0.self_attn.q_norm"]),
        (DEEPSEEK_V3, 671.0, ["model.layers.2.mlp.gate_up_proj", "model.layers.60.mlp.gate",
                              "model.layers.3.self_attn.kv_b_proj"]),
    ],
)
def test_tree_of_a_config_too_large_to_load(tmp_path, config, billions, paths):
    (tmp_path / "config.json").write_text(json.dumps(config))
    weightless_model(tmp_path, max_model_len=512)  # the first build imports vLLM's model code
    start = time.perf_counter()
    model = weightless_model(tmp_path, max_model_len=512)
    assert time.perf_counter() - start < 5
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)
    modules = dict(model.named_modules())
    assert all(path in modules for path in paths)
    assert config["architectures"][0] in repr(model)
