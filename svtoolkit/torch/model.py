"""TinyLM: a small byte-level pre-norm decoder with a pluggable attention layer.

The backbone of the language-model probe of Forgetful Attention (arXiv:2607.12204, §8,
App. C): token and learned positional embeddings, pre-norm blocks ``x + attn(LN(x))`` and
``x + MLP(LN(x))`` (GELU, width ``mlp_ratio * d_model``), a final LayerNorm and a weight-tied output head. Only the
attention changes between variants; it is looked up by name in
:data:`svtoolkit.torch.layers.ATTENTION_LAYERS`, so every layer of the toolkit (the SV layers
included) drops into the same backbone.

The 3.22M configuration of the paper is the default: ``TinyLM()`` = 4 layers, d_model 256,
4 heads, block 256, vocabulary 256 (bytes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ATTENTION_LAYERS
from .ops._common import check_positive_int

__all__ = ["TinyLM"]


def _dropout(p):
    """nn.Dropout, or nothing at all when p = 0 (no per-call cost in the default model)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class _MLP(nn.Module):
    def __init__(self, d_model, hidden, dropout):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)
        self.dropout = _dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class _Block(nn.Module):
    """Pre-norm block: ``x + drop(attn(LN(x)))``, then ``x + MLP(LN(x))``."""

    def __init__(self, d_model, attention, mlp_ratio, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = attention
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = _MLP(d_model, mlp_ratio * d_model, dropout)
        self.dropout = _dropout(dropout)

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    """Small pre-norm decoder over bytes (or any vocabulary) with a pluggable attention.

    Parameters
    ----------
    vocab : int, default 256
        Vocabulary size (256: raw bytes, no tokenizer).
    d_model : int, default 256
        Model width.
    n_layers : int, default 4
        Number of blocks.
    n_heads : int, default 4
        Attention heads per block.
    block : int, default 256
        Context length: the number of learned positions (inputs may be shorter).
    attn : str, default "softmax"
        A key of :data:`svtoolkit.torch.layers.ATTENTION_LAYERS` (``"softmax"``,
        ``"sliding_window"``, ..., ``"sv"``, ``"sv_hybrid"``).
    attn_options : dict, optional
        Keyword options of the attention layer, e.g. ``{"chunk": 64, "C": 0.25}`` for the SV
        layers; each block gets its own layer ``ATTENTION_LAYERS[attn](d_model, n_heads,
        **attn_options)``.
    mlp_ratio : int, default 4
        Width of the MLP hidden layer in units of ``d_model``.
    dropout : float, default 0.0
        Dropout after the embeddings, the attention output and the MLP output.

    Notes
    -----
    Initialisation: embeddings and the backbone's own linear layers ``N(0, 0.02)`` (the
    residual output of each MLP ``N(0, 0.02 / sqrt(2 n_layers))``, GPT-2 style), biases 0; the
    attention layers keep their own initialisation. The output head shares the token
    embedding matrix. With the defaults (softmax attention) the model has 3,286,528
    parameters; without the positional table (nanoGPT's count, ``num_params(positions=False)``)
    3,220,992 - the paper's "3.22M".

    Examples
    --------
    >>> import torch
    >>> from svtoolkit.torch import TinyLM
    >>> model = TinyLM(d_model=32, n_layers=2, n_heads=2, block=16)
    >>> idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    >>> logits, loss = model(idx[:, :-1], targets=idx[:, 1:])
    >>> tuple(logits.shape), loss.ndim
    ((3, 15, 256), 0)
    """

    def __init__(self, vocab=256, d_model=256, n_layers=4, n_heads=4, block=256, *,
                 attn="softmax", attn_options=None, mlp_ratio=4, dropout=0.0):
        super().__init__()
        for name, value in (("vocab", vocab), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("block", block), ("mlp_ratio", mlp_ratio)):
            check_positive_int(name, value)
        if attn not in ATTENTION_LAYERS:
            raise ValueError(f"attn must be one of {sorted(ATTENTION_LAYERS)}; got {attn!r}")
        if attn_options is not None and not isinstance(attn_options, dict):
            raise TypeError(f"attn_options must be a dict; got {type(attn_options).__name__}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0
        ):
            raise ValueError(f"dropout must be a number in [0, 1); got {dropout!r}")
        self.config = dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                           block=block, attn=attn, attn_options=dict(attn_options or {}),
                           mlp_ratio=mlp_ratio, dropout=float(dropout))
        self.vocab, self.block = vocab, block
        layer_cls = ATTENTION_LAYERS[attn]
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block, d_model)
        self.dropout = _dropout(dropout)
        self.blocks = nn.ModuleList(
            _Block(d_model, layer_cls(d_model, n_heads, **self.config["attn_options"]),
                   mlp_ratio, dropout)
            for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self._init_backbone(n_layers)

    def _init_backbone(self, n_layers):
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        for block in self.blocks:
            for linear, std in ((block.mlp.fc, 0.02),
                                (block.mlp.proj, 0.02 / math.sqrt(2 * n_layers))):
                nn.init.normal_(linear.weight, std=std)
                nn.init.zeros_(linear.bias)

    def forward(self, idx, targets=None):
        """Logits of the next token at every position, and the mean cross-entropy.

        Parameters
        ----------
        idx : LongTensor of shape (B, T)
            Token ids in ``[0, vocab)``, ``T <= block``.
        targets : LongTensor of shape (B, T), optional
            Next-token ids; positions with ``-1`` are ignored.

        Returns
        -------
        logits : Tensor of shape (B, T, vocab)
        loss : Tensor (scalar) or None
            Mean cross-entropy in nats (divide by ``ln 2`` for bits per byte); None without
            targets.
        """
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.ndim != 2:
            desc = (f"{idx.dtype} tensor of shape {tuple(idx.shape)}"
                    if isinstance(idx, torch.Tensor) else type(idx).__name__)
            raise ValueError(f"idx must be an int64 tensor of shape (B, T); got {desc}")
        B, T = idx.shape
        if T > self.block:
            raise ValueError(f"sequence length {T} exceeds the model's block size {self.block}")
        positions = torch.arange(T, device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}")
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    def num_params(self, positions=True):
        """Number of parameters (the tied head counted once; without the positional table
        when ``positions=False``)."""
        total = sum(p.numel() for p in self.parameters())
        return total if positions else total - self.pos_emb.weight.numel()
