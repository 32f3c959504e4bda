"""Models from well-known libraries, unmodified: a job's only user code is a factory here.

Jobs name them ``libmodels:<function>``; the tests put this directory on the daemons'
``PYTHONPATH``. The libraries are the ``libs`` extra (``pip install -e .[libs]``): where one is
absent, :func:`missing` says so and its tests skip.

The torchvision wheels on PyPI are built against a CUDA torch: against a CPU-only torch their
``_C`` extension does not load, and importing torchvision then fails while it registers fake
kernels for the detection operators ``torchvision::nms``/``qnms`` (transformers imports
torchvision where it is installed, so it fails too). The classifiers use neither operator:
:func:`_import_torchvision` declares the two schemas when that happens, and the import
completes. It changes no model.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch
from torch import nn

# the declarations of the detection operators, where torchvision's _C did not load; kept
# alive here, as a torch.library.Library drops its definitions when it is collected
_DECLARED: list[Any] = []


def _import_torchvision() -> None:
    """Import torchvision, declaring ``nms``/``qnms`` where its compiled operators are absent."""
    try:
        importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED.append(lib)
        importlib.import_module("torchvision")


def missing(library: str) -> str | None:
    """Why ``library`` (``"torchvision"`` or ``"transformers"``) cannot be used here, or None."""
    if importlib.util.find_spec(library) is None:
        return f"{library} is not installed (pip install -e .[libs])"
    try:
        _import_torchvision() if library == "torchvision" else _transformers()
    except Exception as exc:  # an install that does not import: say how, and skip
        return f"{library} does not import: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def _transformers() -> Any:
    """The transformers package, torchvision made importable first where it is installed."""
    if importlib.util.find_spec("torchvision") is not None:
        _import_torchvision()
    return importlib.import_module("transformers")


# -- torchvision ----------------------------------------------------------------------------


def resnet18(classes: int = 10) -> nn.Module:
    """torchvision's ``resnet18`` with ``classes`` outputs, as torchvision builds it. Its
    natural units: ``conv1``, ``bn1``, ``relu``, ``maxpool``, the eight basic blocks
    ``layer1.0`` .. ``layer4.1``, ``avgpool``, ``fc`` (14 blocks)."""
    _import_torchvision()
    from torchvision.models import resnet18 as build

    return build(num_classes=classes)


# -- Hugging Face transformers --------------------------------------------------------------


def tiny_gpt2(
    vocab: int = 64, dim: int = 32, layers: int = 4, seq: int = 16, dropout: float = 0.0
) -> nn.Module:
    """A Hugging Face GPT-2 causal language model of a tiny configuration, as transformers
    builds it (the output head tied to the token embedding)."""
    t = _transformers()
    config = t.GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=dim,
        n_layer=layers,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return t.GPT2LMHeadModel(config)


def tiny_llama_config(vocab: int = 64, dim: int = 32, layers: int = 4, seq: int = 16) -> Any:
    """The configuration of :func:`tiny_llama`."""
    return _transformers().LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        tie_word_embeddings=True,
    )


def tiny_llama(vocab: int = 64, dim: int = 32, layers: int = 4, seq: int = 16) -> nn.Module:
    """A Hugging Face Llama causal language model of a tiny configuration, built as
    ``AutoModelForCausalLM.from_config`` builds it (its output head tied to the token
    embedding). Its natural units: ``model.embed_tokens``, ``model.layers.0`` .. ``3``,
    ``model.norm``, ``lm_head`` (7 blocks)."""
    config = tiny_llama_config(vocab, dim, layers, seq)
    return _transformers().AutoModelForCausalLM.from_config(config)


class TokenIds(torch.utils.data.Dataset):
    """Mappings of ``input_ids`` and ``labels`` (a causal language model's batch: the model
    shifts the labels itself), rows of ``length`` token ids below ``vocab``."""

    def __init__(self, vocab: int = 64, length: int = 8, n: int = 64) -> None:
        self.vocab, self.length, self.n = vocab, length, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.length) * (i % 7 + 1) + i) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


def token_ids(vocab: int = 64, length: int = 8) -> TokenIds:
    """:class:`TokenIds`: the data of the Hugging Face jobs (``libmodels:token_ids``)."""
    return TokenIds(vocab, length)
