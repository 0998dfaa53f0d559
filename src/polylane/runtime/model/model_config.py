"""The shape of a decoder: every hyper-parameter the forward pass and the KV cache need.

Built by the architecture modules from a GGUF header or a Hugging Face `config.json`; the decoder
and the cache read only this object, never the file's own keys.
"""

from __future__ import annotations

from dataclasses import dataclass

GLOBAL = "global"
SLIDING = "sliding"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "gemma3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    layer_types: tuple[str, ...]  # GLOBAL or SLIDING per layer
    sliding_window: int | None = None  # a SLIDING query sees keys with q_pos - k_pos < window
    rope_local_theta: float | None = None  # RoPE base of SLIDING layers, when it differs
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # extra norms after attention and after the MLP (Gemma)
    embedding_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # None: head_dim ** -0.5
    activation: str = "silu"  # "silu" | "gelu_tanh"
    final_logit_softcap: float | None = None
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types
