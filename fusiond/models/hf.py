"""Hugging Face `transformers` GPT2LMHeadModel, built offline from a config (optional)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from fusiond.models.gpt2 import lm_loss


def hf_gpt2(**config: Any) -> nn.Module:
    """A randomly initialised `GPT2LMHeadModel` from `GPT2Config(**config)`; no download.

    Raises ImportError when transformers is not installed (it is an optional dependency).
    Caching of past key/values is off (training), attention is SDPA.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**{"use_cache": False, **config})
    model = GPT2LMHeadModel(cfg)
    return model


def hf_small_config() -> dict[str, Any]:
    """A tiny GPT-2 config for tests."""
    return {
        "vocab_size": 128,
        "n_positions": 64,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def hf_lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy from a `CausalLMOutput` (or plain logits)."""
    logits = out.logits if hasattr(out, "logits") else out
    return lm_loss(logits, targets)


def hf_model(architecture: str, **config: Any) -> nn.Module:
    """A randomly initialised Hugging Face model, `transformers.<architecture>`, built offline
    from `<its config class>(**config)` (e.g. `architecture = "LlamaForCausalLM"` with
    `hidden_size`, `num_hidden_layers`, ...); no download. Caching of past key/values is off
    (training) unless the config says otherwise.

    Raises ImportError without transformers, ValueError for a name that is not a model class.
    """
    import transformers

    cls = getattr(transformers, architecture, None)
    base = getattr(transformers, "PreTrainedModel", None)
    if not (isinstance(cls, type) and base is not None and issubclass(cls, base)):
        raise ValueError(f"transformers has no model class {architecture!r} (e.g. "
                         "'LlamaForCausalLM', 'BertForMaskedLM', 'T5ForConditionalGeneration', "
                         "'ViTForImageClassification')")
    cfg_cls: Any = getattr(cls, "config_class")  # noqa: B009 (a transformers class attribute)
    extra = {"use_cache": False} if "use_cache" in inspect.signature(cfg_cls).parameters or \
        hasattr(cfg_cls(), "use_cache") else {}
    cfg = cfg_cls(**{**extra, **config})
    model: nn.Module = cls(cfg)
    return model
