"""The model families the pipeline takes, in one table, and what each needs from every stage.

A family is named by its Hugging Face ``model_type`` (config.json). For each: its HF architecture, ModelOpt's
``decoder_type`` for ``export_tensorrt_llm_checkpoint`` (modelopt/torch/export/model_config_export.py), what
its decoder layers hold beyond Llama's (the checkpoint reader, pipeline/quant/checkpoint.py, reads them back:
q/k/v biases as ``attention.qkv.bias``, per-head q/k norms as ``attention.q_layernorm`` / ``k_layernorm``), and
the build targets that can serve it. The CPU runtime runs transformers' own modelling code for the family with
its paged KV cache and batching, so it needs little per family: the sliding window (``attention_window``) and
the widths of a cached key and value (``kv_head_dims``). In every family of the TensorRT-LLM checkpoint q/k/v are
fused into one GEMM (attention.qkv); a dense MLP's gate/up stay separate in the TensorRT-LLM checkpoint and are
fused in the HF unified one (pipeline/quant/sensitivity.py ``fusion_groups_for``). Dense families keep nothing
in high precision by default beyond the plan's rules.

Mixture-of-experts families (``Family.moe``) have, per decoder layer, a router (a linear giving each token's
expert scores, or, in DeepSeek-V2, a module holding its weight that gives the chosen experts) and a list of
experts, each a gated MLP. What is built for them: the sensitivity stage measures
every expert on the calibration tokens the router sends it and summarises each layer's experts per expert type;
the router is measured and recorded; the plan keeps routers in high precision (ModelOpt exports them in fp32 in
``build_moe_config``) and gives all the experts of a layer one format, because the checkpoint stacks them into
one tensor per expert type and TensorRT-LLM's fused MoE layer runs them with one quantization method
(tensorrt_llm/_torch/modules/fused_moe: ``_get_quant_method`` reads the layer's one ``layer_quant_mode``).
Quantize and export: the experts in FP8, INT4 AWQ or W4A8 AWQ (what ModelOpt's TensorRT-LLM export writes for
stacked experts; pipeline/quant/quantize.py ``MOE_EXPORT_FORMATS``), at any tensor parallel size that splits
their intermediate size; the checkpoint reader reads the stacked experts back per expert, joining the ranks.

The vllm target's export (pipeline/engines/vllm/export.py) writes dense layers with their biases and q/k norms
(Llama, Mistral, Qwen2, Qwen3) and MoE layers as vLLM's Mixtral and Qwen3-MoE load them: the router unquantized,
each expert's gate/up/down under its HF name, a layer's experts in one compressed-tensors scheme. For the
families with the HF unified checkpoint only (Phi-3, Gemma 3, DeepSeek-V2) the vLLM export starts from that
checkpoint (pipeline/engines/vllm/export_hf.py), folding smoothing where ``Family.layout`` (and, for DeepSeek-V2,
its multi-head latent attention and shared experts) says each linear's input comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import targets
from pipeline.errors import InputError

# the targets that serve every family whose layers their export holds (Target.every_family); EDGE_TARGETS add
# TensorRT Edge-LLM for the families its export supports (tests/data/upstream/edgellm.json)
ALL_TARGETS = tuple(name for name, t in targets.REGISTRY.items() if t.every_family)
EDGE_TARGETS = (*ALL_TARGETS, "edge")


@dataclass(frozen=True)
class MoE:
    router: str  # the router's path in a decoder layer
    experts: str  # the expert list's path in a decoder layer
    fused: tuple[str, str]  # an expert's gate and up linears: they read the same input, the export fuses them
    down: str  # an expert's down linear
    top_k: str  # the config.json key: experts per token


@dataclass(frozen=True)
class Layout:
    """A dense decoder layer by its HF module names: what computes each linear's input, for an export that folds
    smoothing scales into it (pipeline/engines/vllm/export_hf.py). ``qkv`` / ``gate_up`` with one name: the
    family stores them as one linear (Phi-3), q/k/v rows or gate rows first."""

    attn_norm: str = "input_layernorm"
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    mlp_norm: str = "post_attention_layernorm"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    unit_offset_norms: bool = False  # the RMSNorms scale by (1 + w) (Gemma), the final one too


@dataclass(frozen=True)
class Family:
    model_type: str
    hf_architecture: str
    decoder_type: str  # ModelOpt export_tensorrt_llm_checkpoint(decoder_type=...)
    extras: str  # what the layers hold beyond Llama's
    targets: tuple[str, ...]  # what has run end to end where: docs/concepts/families.md
    moe: MoE | None = None
    why_not: str = ""  # why the other targets cannot serve it (default: its extras are not in their export)
    # False: quantize exports the HF unified checkpoint only (the pytorch target's), read back and gated by
    # pipeline.quant.hf_checkpoint, and the CPU runtime serves that; the TensorRT-LLM checkpoint, which the engine
    # and the vLLM export start from, cannot be written here
    trtllm_checkpoint: bool = True
    # the linears the family stores fused that TensorRT-LLM's pytorch backend splits itself on loading, and the
    # formats that survive that split (None: no such linears); others must stay in high precision
    fused_formats: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    # the embedding rows are multiplied by sqrt(hidden size) before the first decoder layer (Gemma's
    # ScaledWordEmbedding); code that runs the layers one at a time (the sensitivity stage) must do the same
    scaled_embedding: bool = False
    layout: Layout = Layout()
    # transformers' attention the stages run the family with: "sdpa", or "eager" where SDPA would compute
    # something else (Gemma 2's attention soft-capping: sdpa_attention_forward ignores ``softcap``)
    attention: str = "sdpa"


# why a family without a TensorRT-LLM checkpoint here is not served by the engine (the pytorch target, the CPU
# runtime and the vLLM export read the HF unified checkpoint)
_HF_ONLY = ("ModelOpt writes no TensorRT-LLM checkpoint of it without tensorrt_llm installed, and the engine "
            "starts from that checkpoint")


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", "", EDGE_TARGETS),
    Family("mistral", "MistralForCausalLM", "llama", "", ALL_TARGETS),
    Family("qwen2", "Qwen2ForCausalLM", "qwen", "q/k/v biases", EDGE_TARGETS),
    Family("qwen3", "Qwen3ForCausalLM", "qwen", "per-head q/k RMSNorms", EDGE_TARGETS),
    # ModelOpt's MODEL_NAME_TO_TYPE maps MixtralForCausalLM to the llama decoder (model_utils.py)
    Family("mixtral", "MixtralForCausalLM", "llama", "a router and experts per layer (MoE)",
           ALL_TARGETS,
           MoE("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3"), "w2", "num_experts_per_tok")),
    # ModelOpt's TensorRT-LLM export writes Qwen3-MoE with the qwen decoder, but without tensorrt_llm installed
    # its config.json lacks the `moe` section (num_experts, top_k) an engine build needs: pytorch and cpu targets
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen",
           "per-head q/k RMSNorms; a router and experts per layer (MoE)", ("pytorch", "cpu", "vllm"),
           MoE("mlp.gate", "mlp.experts", ("gate_proj", "up_proj"), "down_proj", "num_experts_per_tok"),
           "ModelOpt's TensorRT-LLM checkpoint of it has no moe section for an engine build"),
    # Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer with q/k/v as one linear (qkv_proj) and gate/up as one
    # (gate_up_proj). ModelOpt 0.47 writes a TensorRT-LLM checkpoint config for it only through tensorrt_llm's
    # own Phi3 config class (tensorrt_llm_utils.py convert_to_tensorrt_llm_config: its manual path raises
    # NotImplementedError for phi3), so here it is the HF unified checkpoint, served by the pytorch target, the
    # CPU runtime and vLLM (whose Phi3ForCausalLM loads qkv_proj and gate_up_proj whole, as they are stored)
    Family("phi3", "Phi3ForCausalLM", "phi3", "fused q/k/v (qkv_proj) and gate/up (gate_up_proj) linears",
           ("pytorch", "cpu", "vllm"), why_not=_HF_ONLY, trtllm_checkpoint=False,
           layout=Layout(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
           # TensorRT-LLM's pytorch Phi3ForCausalLM.load_weights splits qkv_proj / gate_up_proj by rows and hands
           # the halves per-tensor scales only: FP8 loads; a per-channel INT8 scale, SmoothQuant's pre-quant scale
           # and packed INT4 rows do not (tests/data/upstream/pytorch_fused_loaders.json)
           fused_formats=(("qkv_proj", "gate_up_proj"), ("fp8",))),
    # Gemma 3 text models (1B; the larger ones are Gemma3ForConditionalGeneration): (1 + w) RMSNorms before and
    # after attention and the MLP, embeddings scaled by sqrt(hidden), per-head q/k norms, sliding-window layers
    # with their own rotary base. ModelOpt 0.47 writes no TensorRT-LLM config for it without tensorrt_llm (as
    # phi3). The MLP reads pre_feedforward_layernorm (post_attention_layernorm normalises the attention's output)
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3",
           "(1 + w) norms around attention and MLP, scaled embeddings, q/k norms, sliding-window layers",
           ("pytorch", "cpu", "vllm"), why_not=_HF_ONLY, trtllm_checkpoint=False, scaled_embedding=True,
           layout=Layout(mlp_norm="pre_feedforward_layernorm", unit_offset_norms=True)),
    # Gemma 2: Gemma 3's layer without q/k norms, every other layer sliding (layer_types), the attention scores
    # and the final logits soft-capped (tanh): transformers' SDPA path drops the attention capping, so every stage
    # runs it with eager attention. ModelOpt 0.47 writes no TensorRT-LLM config for it (as gemma3), and TensorRT-LLM
    # 1.2's PyTorch backend does not list Gemma2ForCausalLM (tests/data/upstream/pytorch_backend_models.json)
    Family("gemma2", "Gemma2ForCausalLM", "gemma2",
           "attention and final-logit soft-capping (eager attention), (1 + w) norms around attention and MLP, scaled "
           "embeddings, alternating sliding-window layers", ("cpu", "vllm"),
           why_not="TensorRT-LLM 1.2's PyTorch backend does not list Gemma2ForCausalLM, and ModelOpt writes no "
                   "TensorRT-LLM checkpoint of it for the engine",
           trtllm_checkpoint=False, scaled_embedding=True,
           layout=Layout(mlp_norm="pre_feedforward_layernorm", unit_offset_norms=True), attention="eager"),
    # DeepSeek-V2 / V2-Lite (the seeds' model): multi-head latent attention (q_proj, or q_a_proj / q_b_proj where
    # q_lora_rank is set; kv_a_proj_with_mqa, kv_b_proj), the first first_k_dense_replace layers dense, the others
    # a router (DeepseekV2MoEGate: a weight, not an nn.Linear, giving the chosen experts) with routed experts and
    # always-on shared experts (mlp.shared_experts, a dense MLP). ModelOpt 0.47 writes no TensorRT-LLM checkpoint
    # of it (tensorrt_llm_utils.py raises NotImplementedError for deepseek) and TensorRT-LLM 1.2's PyTorch backend
    # does not take DeepseekV2ForCausalLM (tests/data/upstream/pytorch_backend_models.json): here the CPU runtime
    # serves its HF unified checkpoint, and vLLM the export written from it (pipeline/engines/vllm/export_hf.py)
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek",
           "multi-head latent attention; a router, routed experts and shared experts per layer (MoE)", ("cpu", "vllm"),
           MoE("mlp.gate", "mlp.experts", ("gate_proj", "up_proj"), "down_proj", "num_experts_per_tok"),
           why_not="TensorRT-LLM 1.2's PyTorch backend does not list DeepseekV2ForCausalLM, and ModelOpt writes no "
                   "TensorRT-LLM checkpoint of it for the engine",
           trtllm_checkpoint=False),
)}


def attn_implementation(model_type: str) -> str:
    """transformers' attention implementation for a model of ``model_type`` (``Family.attention``; sdpa for one
    outside the table, which the stages refuse before running it)."""
    fam = FAMILIES.get(model_type)
    return fam.attention if fam else "sdpa"


def embedding_scale(hf) -> float:
    """What the model multiplies its embedding rows by before the first decoder layer (``Family.scaled_embedding``:
    sqrt(hidden size), as transformers' Gemma3TextScaledWordEmbedding; else 1)."""
    return hf.hidden_size ** 0.5 if FAMILIES[hf.model_type].scaled_embedding else 1.0


def position_kwargs(model, hf, hidden, positions) -> dict:
    """The rotary position embeddings a decoder layer of ``model`` takes, as keyword arguments: one pair
    (``position_embeddings``) for most families; for Gemma 3 a global pair and a local one, its sliding-window
    layers rotating with ``rope_local_base_freq`` and no scaling (transformers 4.57 Gemma3TextModel builds its
    ``rotary_emb_local`` so). Made on ``hidden``'s device from the config: ``model`` may be a meta skeleton."""
    import copy

    global_ = type(model.model.rotary_emb)(config=hf).to(hidden.device)(hidden, positions)
    if not hasattr(model.model, "rotary_emb_local"):
        return {"position_embeddings": global_}
    local_cfg = copy.deepcopy(hf)
    local_cfg.rope_theta = hf.rope_local_base_freq
    local_cfg.rope_scaling = {"rope_type": "default"}
    local = type(model.model.rotary_emb_local)(config=local_cfg).to(hidden.device)(hidden, positions)
    return {"position_embeddings_global": global_, "position_embeddings_local": local}


def attention_window(config) -> tuple[int | None, bool]:
    """(window, per_type): the sliding window a model's attention keeps to, as transformers reads its config, and
    whether only some layers slide (``layer_types`` naming ``sliding_attention``: Gemma 3, Qwen2 with
    use_sliding_window), the model then taking one mask per layer type; (None, False) where every layer sees the
    whole sequence. Without ``layer_types`` a set ``sliding_window`` applies to every layer (Mistral, Mixtral,
    Phi-3: their models pick ``create_sliding_window_causal_mask`` for all)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None, False
    return window, types is not None


def layer_window(config, i: int) -> int | None:
    """The sliding window decoder layer ``i`` keeps to (``attention_window``), None where it sees everything."""
    window, per_type = attention_window(config)
    return window if window and (not per_type or config.layer_types[i] == "sliding_attention") else None


def additive_mask(allowed, qpos, kpos, window: int | None = None):
    """The additive attention mask (0 where a query may see a key, the dtype's minimum elsewhere, float32) for
    queries at positions ``qpos`` and keys at ``kpos`` (broadcastable to ``allowed``), cut to the last ``window``
    positions where one is given: transformers' sliding_window_overlay, key > query - window."""
    import torch

    if window:
        allowed = allowed & (kpos > qpos - window)
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


def kv_head_dims(hf) -> tuple[int, int]:
    """The widths of one KV head's key and value as the model caches them: both ``head_dim`` for most families;
    for multi-head latent attention (DeepSeek-V2: ``kv_lora_rank`` set) transformers caches each head's full key
    (``qk_nope_head_dim`` + ``qk_rope_head_dim``) and value (``v_head_dim``)."""
    if getattr(hf, "kv_lora_rank", None):
        return hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim
    return head_dim(hf), head_dim(hf)


def head_dim(hf) -> int:
    """An attention head's width from a transformers config: its ``head_dim`` where it sets one (Qwen3, Gemma),
    else the hidden size over the query heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def family(model_type: str, target: str | None = None) -> Family:
    """The family of ``model_type``; an InputError naming the supported ones when it is not in the table, or
    the targets that serve it when ``target`` is not one of them."""
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise InputError(unsupported_message(model_type))
    if target is not None and target not in fam.targets:
        raise InputError(cannot_serve_message(fam, target))
    return fam


def unsupported_message(model_type: str) -> str:
    return (f"model type {model_type!r} is not a supported family; supported: "
            f"{', '.join(f'{f.model_type} ({f.hf_architecture})' for f in FAMILIES.values())}")


def cannot_serve_message(fam: Family, target: str) -> str:
    why = targets.get(target).families_note or fam.why_not or f"{fam.extras} are not in its export"
    return f"the {target} target cannot serve {fam.model_type} ({why}); use build.target {' or '.join(fam.targets)}"
