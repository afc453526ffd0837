"""What worker.py asks of the model inside vLLM's worker processes (``LLM.apply_model``), in a module of its own:
vLLM pickles the function by reference, and its engine and worker processes import it by this module's name
(worker.py's folder is on their ``sys.path``), which a function of worker.py's ``__main__`` cannot be.
Standard library only, as worker.py."""


def served_kv_scales(model) -> dict:
    """Each attention layer's K and V scales as its kernels read them (``_k_scale_float`` / ``_v_scale_float``:
    what vLLM 0.32's CPU and CUDA attention backends are handed)."""
    return {name: [m._k_scale_float, m._v_scale_float] for name, m in model.named_modules()
            if hasattr(m, "_k_scale_float") and hasattr(m, "kv_cache_dtype")}
