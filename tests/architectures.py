"""Tiny configs of the MoE, MLA, hybrid (state + attention) and pure state families.

Built from transformers' own config classes, small enough that a model builds and
generates in well under a second; ``STATE_ARCHITECTURES`` keep a per-request state
(Mamba / Mamba2 mixers, gated delta rule, short convolutions, lightning attention), ``MOE_ARCHITECTURES``
and ``MLA_ARCHITECTURES`` only K/V.
"""

from __future__ import annotations

from typing import Any

SMALL: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def _moe(cls_name: str, **extra: Any) -> Any:
    import transformers as tf

    return getattr(tf, cls_name)(**{**SMALL, "num_hidden_layers": 2, **extra})


def _mamba2_fields(prefix: str = "mamba_") -> dict[str, Any]:
    return {
        f"{prefix}n_heads": 4,
        f"{prefix}d_head": 32,
        f"{prefix}n_groups": 1,
        f"{prefix}d_state": 16,
        f"{prefix}d_conv": 4,
        f"{prefix}expand": 2,
        f"{prefix}chunk_size": 16,
    }


def build_config(arch: str) -> Any:
    import transformers as tf

    # -- mixture of experts (K/V only) ----------------------------------------------
    if arch == "mixtral":
        return _moe("MixtralConfig", **MOE)
    if arch == "qwen2_moe":
        return _moe(
            "Qwen2MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
    if arch == "qwen3_moe":
        return _moe(
            "Qwen3MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            head_dim=16,
        )
    if arch == "olmoe":
        return _moe("OlmoeConfig", num_experts=4, num_experts_per_tok=2)
    if arch == "granitemoe":
        return _moe("GraniteMoeConfig", **MOE)
    if arch == "phimoe":
        return _moe("PhimoeConfig", **MOE)
    if arch == "jetmoe":
        return tf.JetMoeConfig(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=16,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
    if arch == "glm4_moe":
        return _moe(
            "Glm4MoeConfig",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            head_dim=16,
        )
    if arch == "ernie4_5_moe":
        return _moe(
            "Ernie4_5_MoeConfig",
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=64,
        )
    if arch == "hunyuan_v1_moe":
        return _moe("HunYuanMoEV1Config", num_experts=4, moe_topk=2, head_dim=16)
    # -- multi-head latent attention (K/V through the attention interface) -------------
    if arch == "deepseek_v2":
        return _moe(
            "DeepseekV2Config",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
        )
    if arch == "deepseek_v3":
        return _moe(
            "DeepseekV3Config",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
        )
    # -- state layers, with or without attention -----------------------------------
    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(
            **{**SMALL, "num_hidden_layers": 4},
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            layer_types=[
                "linear_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
        )
    if arch == "lfm2":
        return tf.Lfm2Config(
            **{**SMALL, "num_hidden_layers": 3},
            layer_types=["conv", "full_attention", "conv"],
            block_auto_adjust_ff_dim=False,
        )
    if arch == "falcon_h1":
        return tf.FalconH1Config(
            **{**SMALL, "num_hidden_layers": 2},
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
        )
    if arch == "bamba":
        return tf.BambaConfig(
            **{**SMALL, "num_hidden_layers": 3}, attn_layer_indices=[1], **_mamba2_fields()
        )
    if arch == "jamba":
        return tf.JambaConfig(
            **{**SMALL, "num_hidden_layers": 4},
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
        )
    if arch == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **{**SMALL, "num_hidden_layers": 3},
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
            layer_types=["mamba", "attention", "mamba"],
            **_mamba2_fields(),
        )
    if arch == "nemotron_h":
        return tf.NemotronHConfig(
            **{**SMALL, "num_hidden_layers": 4},
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            head_dim=16,
            ssm_state_size=16,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
        )
    if arch == "zamba2":
        return tf.Zamba2Config(
            **{**SMALL, "num_hidden_layers": 4},
            layers_block_type=["mamba", "hybrid", "mamba", "mamba"],
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_ngroups=1,
            n_mamba_heads=4,
            chunk_size=16,
            adapter_rank=8,
        )
    if arch == "kimi_linear":
        return tf.KimiLinearConfig(
            **{**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 4},
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
        )
    if arch == "minimax":
        return tf.MiniMaxConfig(
            **{**SMALL, "num_hidden_layers": 2},
            head_dim=16,
            **MOE,
            layer_types=["linear_attention", "full_attention"],
            block_size=16,
        )
    if arch == "mamba":
        return tf.MambaConfig(
            vocab_size=256,
            hidden_size=64,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.2,
            tie_word_embeddings=False,
            use_mambapy=False,
        )
    if arch == "mamba2":
        return tf.Mamba2Config(
            vocab_size=256,
            hidden_size=64,
            num_heads=4,
            head_dim=32,
            state_size=16,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            n_groups=1,
            chunk_size=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
    # -- attention sinks, compressed caches ------------------------------------------
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            **{**SMALL, "num_hidden_layers": 2},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
    if arch in ("deepseek_v4", "deepseek_v4_compressed"):
        # Sliding-window layers with sinks run; compressed ones (CSA/HCA) are refused.
        compressed = arch == "deepseek_v4_compressed"
        layer_types = ["heavily_compressed_attention", "compressed_sparse_attention"]
        return tf.DeepseekV4Config(
            layer_types=layer_types if compressed else ["sliding_attention"] * 2,
            **{**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 1},
            head_dim=32,
            q_lora_rank=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            o_groups=2,
            o_lora_rank=32,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=8,
            sliding_window=8,
            num_nextn_predict_layers=0,
            hc_mult=2,
        )
    raise KeyError(arch)


MOE_ARCHITECTURES = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "granitemoe",
    "jetmoe",
    "glm4_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "phimoe",
]
MLA_ARCHITECTURES = ["deepseek_v2", "deepseek_v3"]
STATE_ARCHITECTURES = [
    "qwen3_next",
    "lfm2",
    "falcon_h1",
    "bamba",
    "jamba",
    "granitemoehybrid",
    "nemotron_h",
    "zamba2",
    "kimi_linear",
    "minimax",
    "mamba",
    "mamba2",
]
SINK_ARCHITECTURES = ["gpt_oss", "deepseek_v4"]
# Refused at construction, with what they keep that cbgen cannot hold.
REFUSED_ARCHITECTURES = {
    "deepseek_v4_compressed": "compressed attention entries",
}
