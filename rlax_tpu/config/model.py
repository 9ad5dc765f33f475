"""The model section: architecture, dtypes and where the weights come from."""

from __future__ import annotations

from typing import Literal

from rlax_tpu.config.checks import bad, frozen, non_negative, positive

# Families whose MLPs are experts.
MOE_ARCHS = ("qwen3_moe", "mixtral")
EXPERT_KERNELS = ("auto", "ragged_dot", "megablox", "megablox_interpret")
# The projections LoRA adapters may sit beside (their parameter names in models/layers.py).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@frozen
class ModelConfig:
    """Decoder-only transformer (Llama / Qwen2 / Qwen3 families; Qwen3-MoE and Mixtral experts)."""

    # Family: tensor names, biases and norms follow it.
    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = "llama"
    vocab_size: int = 512  # tokens in the vocabulary (embedding rows)
    hidden_size: int = 128  # model width
    intermediate_size: int = 384  # MLP hidden width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 0  # per-head width; 0: hidden_size // num_heads
    rope_theta: float = 10_000.0  # RoPE frequency base
    # "dynamic" (NTK) picks its base from the longest position of each call, so past
    # max_position_embeddings cached decoding and the full forward disagree (models/rope.py).
    # RoPE context scaling.
    rope_scaling: Literal["none", "linear", "dynamic", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = 1.0  # context extension factor of rope_scaling
    # Context length the model was pretrained with, for llama3 / yarn scaling; 0: max_position_embeddings.
    rope_original_max_position_embeddings: int = 0
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low-frequency wavelength factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high-frequency wavelength factor
    rope_beta_fast: float = 32.0  # yarn: rotations where interpolation starts
    rope_beta_slow: float = 1.0  # yarn: rotations where interpolation is full
    rope_attention_factor: float = 0.0  # yarn cos/sin scale; 0: 0.1 * ln(factor) + 1
    max_position_embeddings: int = 2048  # longest sequence (prompt + generation) the model takes
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    qkv_bias: bool = False  # qwen2: q, k, v biases; llama / qwen3 (HF attention_bias): q, k, v, o
    qk_norm: bool = False  # RMSNorm on queries and keys per head (qwen3)
    tie_embeddings: bool = True  # the output projection is the embedding matrix
    # Storage dtype: the weights as loaded or initialized, as inference workers hold them and as
    # the trainer's frozen reference copy keeps them. The trainer's own copy is trainer.master_dtype.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Compute dtype: activations and matmul inputs; weights are cast to it where used (bf16 on TPU).
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # Where the initial weights come from: random init (seeded), HF safetensors dir, or a GGUF file.
    weights_format: Literal["init", "safetensors", "gguf"] = "init"
    weights_path: str = ""  # the safetensors directory or GGUF file of weights_format
    tokenizer_path: str = ""  # "" means: the tokenizer that comes with the weights / the task
    seed: int = 0  # seed of the random init (weights_format "init")
    # LoRA adapters (0: none): ΔW = (lora_alpha / lora_rank) · A·B beside each projection named
    # in lora_targets, A random Gaussian and B zero at init (Hu et al. 2021, §4.1), float32.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank
    lora_targets: tuple[str, ...] = LORA_TARGETS  # projections that get an adapter
    # Mixture of experts: every layer's MLP is num_experts SwiGLU experts (qwen3_moe and
    # mixtral need them; 0: a dense MLP in every layer).
    num_experts: int = 0
    experts_per_token: int = 2  # experts a token goes to: those of highest router softmax
    expert_intermediate_size: int = 0  # an expert's MLP width; 0: intermediate_size
    # The chosen experts' weights renormalized to sum to 1 (Mixtral always; Qwen3-MoE's config);
    # False: the router's softmax probabilities as they are.
    norm_topk_prob: bool = True
    # The experts' grouped matmuls (rlax_tpu.models.grouped_matmul): "auto" (megablox's Pallas
    # kernels when compiled for TPU, jax.lax.ragged_dot elsewhere), "ragged_dot", "megablox",
    # or "megablox_interpret" (the kernels in Pallas's interpreter: CPU tests).
    expert_kernel: str = "auto"

    def __post_init__(self) -> None:
        positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "rope_theta",
            "max_position_embeddings",
            "rms_norm_eps",
        )
        non_negative(self, "head_dim", "lora_rank", "num_experts", "expert_intermediate_size")
        positive(self, "lora_alpha")
        if self.arch in MOE_ARCHS and not self.num_experts:
            raise bad(self, "num_experts", f"must be > 0 for arch {self.arch!r}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise bad(
                self, "experts_per_token", f"must be in [1, num_experts = {self.num_experts}]"
            )
        if self.expert_kernel not in EXPERT_KERNELS:
            raise bad(self, "expert_kernel", f"must be one of {list(EXPERT_KERNELS)}")
        if self.num_experts and self.lora_rank:
            raise bad(self, "lora_rank", "LoRA on mixture-of-experts models is not built yet")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or not self.lora_targets:
            raise bad(self, "lora_targets", f"must name some of {list(LORA_TARGETS)}")
        if self.num_heads % self.num_kv_heads:
            raise bad(
                self,
                "num_kv_heads",
                f"must divide num_heads ({self.num_heads}) for grouped-query attention",
            )
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise bad(
                self,
                "hidden_size",
                f"must be divisible by num_heads ({self.num_heads}) when head_dim is 0",
            )
        if self.rope_scaling_factor < 1.0:
            raise bad(self, "rope_scaling_factor", "must be >= 1")
        if self.rope_scaling == "none" and self.rope_scaling_factor != 1.0:
            raise bad(self, "rope_scaling_factor", "is set but rope_scaling is 'none'")
        non_negative(self, "rope_original_max_position_embeddings", "rope_attention_factor")
        if self.rope_scaling == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise bad(
                self,
                "rope_high_freq_factor",
                f"must be > rope_low_freq_factor ({self.rope_low_freq_factor}) > 0 for llama3 RoPE",
            )
        if self.rope_scaling == "yarn" and not 0 < self.rope_beta_slow < self.rope_beta_fast:
            raise bad(
                self,
                "rope_beta_fast",
                f"must be > rope_beta_slow ({self.rope_beta_slow}) > 0 for yarn RoPE",
            )
        if self.weights_format != "init" and not self.weights_path:
            raise bad(
                self, "weights_path", f"required when weights_format is '{self.weights_format}'"
            )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a layer, by its name in LORA_TARGETS."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.resolved_head_dim, self.num_kv_heads * self.resolved_head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def param_count(self) -> int:
        """Parameters of the base model (arithmetic on the config; no weights are read)."""
        h, hd = self.hidden_size, self.resolved_head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes = self.projection_shapes()
        layer = sum(a * b for name, (a, b) in shapes.items() if name in ATTENTION) + 2 * h
        if self.num_experts:
            f = self.resolved_expert_intermediate_size
            layer += self.num_experts * 3 * h * f + h * self.num_experts  # experts + router
        else:
            layer += sum(a * b for name, (a, b) in shapes.items() if name not in ATTENTION)
        if self.qkv_bias:  # and o_proj's, but in qwen2 (models/layers.py has_o_bias)
            layer += q + 2 * kv + (h if self.arch != "qwen2" else 0)
        if self.qk_norm:
            layer += 2 * hd
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embeddings + h

    @property
    def resolved_expert_intermediate_size(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    def adapter_count(self) -> int:
        """Parameters of the LoRA adapters (A: in x rank, B: rank x out per target and layer)."""
        shapes = self.projection_shapes()
        per_layer = sum(self.lora_rank * sum(shapes[t]) for t in self.lora_targets)
        return self.num_layers * per_layer

    @property
    def resolved_rope_original_max_position_embeddings(self) -> int:
        return self.rope_original_max_position_embeddings or self.max_position_embeddings
