"""TinyLM: a small byte-level pre-norm decoder with a pluggable attention layer.

The backbone of the language-model probe of Forgetful Attention (arXiv:2607.12204, §8,
App. C): token and learned positional embeddings, pre-norm blocks ``x + attn(LN(x))`` and
``x + MLP(LN(x))`` (GELU, width ``mlp_ratio * d_model``), a final LayerNorm and a weight-tied
output head. Only the attention changes between variants; it is looked up by name in
:data:`svtoolkit.torch.layers.ATTENTION_LAYERS`, so every layer of the toolkit (the SV layers
included) drops into the same backbone.

The 3.22M configuration of the paper is the default: ``TinyLM()`` = 4 layers, d_model 256,
4 heads, block 256, vocabulary 256 (bytes).

Positions are learned absolute embeddings by default (the paper's backbone). Two explicit
options serve the long-context evaluation of Tensor Cache (§4.4), where a model trained on
``block`` tokens is streamed over far longer sequences: ``positions="rotary"`` rotates q and k
inside every attention layer (RoPE, :mod:`svtoolkit.torch.rotary`), with NTK-aware base
scaling beyond the trained block when ``ntk=True`` (the paper's Full-KV baseline), and
``positions="none"`` gives no positional encoding at all (the causal mask is the only order
signal; for layers that have no rotary option, such as the SV layers).

Streaming (inference): :meth:`TinyLM.init_state`, :meth:`TinyLM.forward_with_state` over a
chunk and :meth:`TinyLM.step` over one token go through each attention layer's own streaming
API (KV caches, ring buffers, memories, the SV layers' exact stream), and
:meth:`TinyLM.generate` samples through those caches. Streaming reproduces the full forward
(``forward(idx, exact=True)`` for the SV layers, whose streaming is the exact gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_bool, check_int, check_option, check_real
from .layers import ATTENTION_LAYERS
from .rotary import DEFAULT_BASE

__all__ = ["POSITIONS", "TinyLM", "TinyLMState"]

#: Positional encodings of :class:`TinyLM`.
POSITIONS = ("learned", "rotary", "none")


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

    def forward(self, x, attn_options):
        x = x + self.dropout(self.attn(self.ln_1(x), **attn_options))
        return x + self.mlp(self.ln_2(x))

    def forward_with_state(self, x, state, attn_options):
        h, state = self.attn.forward_with_state(self.ln_1(x), state, **attn_options)
        x = x + self.dropout(h)
        return x + self.mlp(self.ln_2(x)), state

    def step(self, x, state, attn_options):
        h, state = self.attn.step(self.ln_1(x), state, **attn_options)
        x = x + self.dropout(h)
        return x + self.mlp(self.ln_2(x)), state


@dataclass
class TinyLMState:
    """Streaming state of a :class:`TinyLM` (updated in place by the streaming calls).

    Attributes
    ----------
    layers : list
        One attention state per block (None before the first token): the layer's own
        carried state (a ``KVCache``, ``TensorCacheState``, ``InfiniState``,
        ``SVStreamState``, ...).
    position : int
        Tokens processed so far (the position of the next one).
    batch : int
        Number of sequences B.
    ntk_factor : float
        NTK-aware scaling factor of the rotary base used by every call on this state (1: none).
    """

    layers: list
    position: int
    batch: int
    ntk_factor: float = 1.0

    def nbytes(self) -> int:
        """Bytes of the tensors the attention states retain for future tokens.

        KV caches, ring buffers and memories count their tensors (each state's ``nbytes``);
        an SV stream counts the keys and values it still stores (the admitted prefix and the
        current chunk) and its readout's cached prefix tensors, not its solvers' bookkeeping.
        """
        return sum(_state_nbytes(s) for s in self.layers)


def _tensor_bytes(x) -> int:
    return x.numel() * x.element_size()


def _state_nbytes(state) -> int:
    """Retained bytes of one layer's streaming state."""
    if state is None:
        return 0
    if isinstance(state, torch.Tensor):
        return _tensor_bytes(state)
    if isinstance(state, (tuple, list)):
        return sum(_state_nbytes(s) for s in state)
    if callable(getattr(state, "nbytes", None)):
        return int(state.nbytes())
    raise TypeError(f"cannot measure the size of a {type(state).__name__} state")


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
    positions : {"learned", "rotary", "none"}, default "learned"
        "learned": absolute embeddings for positions ``[0, block)`` (sequences are limited to
        ``block``); "rotary": RoPE on q and k inside the attention layers (layers whose class
        sets ``supports_rotary``: the softmax family, Infini-attention, Tensor Cache);
        "none": no positional encoding. With "rotary" and "none" sequences may be longer than
        ``block``.
    rope_base : float, default 10000
        RoPE base (``positions="rotary"``).
    ntk : bool, default False
        NTK-aware base scaling (``positions="rotary"``): a forward over T > block tokens, or a
        stream opened with ``init_state(max_length=L)``, L > block, uses the base
        ``rope_base * (L / block) ** (D / (D - 2))`` (:func:`svtoolkit.torch.rotary.ntk_base`).
        The Full-KV baseline of Tensor Cache (§4.1); bounded windows do not need it.

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
                 attn="softmax", attn_options=None, mlp_ratio=4, dropout=0.0,
                 positions="learned", rope_base=DEFAULT_BASE, ntk=False):
        super().__init__()
        check_option(positions, "positions", POSITIONS)
        ntk = check_bool(ntk, "ntk")
        if ntk and positions != "rotary":
            raise ValueError("ntk=True needs positions='rotary'")
        for name, value in (("vocab", vocab), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("block", block), ("mlp_ratio", mlp_ratio)):
            check_int(value, name, min=1)
        check_option(attn, "attn", tuple(sorted(ATTENTION_LAYERS)))
        if attn_options is not None and not isinstance(attn_options, dict):
            raise TypeError(f"attn_options must be a dict; got {type(attn_options).__name__}")
        check_real(dropout, "dropout", min=0.0, max=1.0, include_max=False)
        self.config = dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                           block=block, attn=attn, attn_options=dict(attn_options or {}),
                           mlp_ratio=mlp_ratio, dropout=float(dropout))
        if positions != "learned":  # the default config (and old checkpoints) stay as they were
            self.config.update(positions=positions, rope_base=float(rope_base), ntk=ntk)
        self.vocab, self.block, self.positions, self.ntk = vocab, block, positions, ntk
        layer_cls = ATTENTION_LAYERS[attn]
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block, d_model) if positions == "learned" else None
        self.dropout = _dropout(dropout)
        self.blocks = nn.ModuleList(
            _Block(d_model, layer_cls(d_model, n_heads, **self.config["attn_options"]),
                   mlp_ratio, dropout)
            for _ in range(n_layers)
        )
        if positions == "rotary":
            if not getattr(layer_cls, "supports_rotary", False):
                raise ValueError(f"attention {attn!r} has no rotary option; use positions="
                                 "'learned' or 'none'")
            for block_ in self.blocks:
                block_.attn.enable_rotary(rope_base)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self._init_backbone(n_layers)

    def _init_backbone(self, n_layers):
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb.weight, std=0.02)
        for block in self.blocks:
            for linear, std in ((block.mlp.fc, 0.02),
                                (block.mlp.proj, 0.02 / math.sqrt(2 * n_layers))):
                nn.init.normal_(linear.weight, std=std)
                nn.init.zeros_(linear.bias)

    def forward(self, idx, targets=None, *, exact=False):
        """Logits of the next token at every position, and the mean cross-entropy.

        Parameters
        ----------
        idx : LongTensor of shape (B, T)
            Token ids in ``[0, vocab)``; ``T <= block`` with learned positions.
        targets : LongTensor of shape (B, T), optional
            Next-token ids; positions with ``-1`` are ignored.
        exact : bool, default False
            Layers that have an exact-gate path (the SV layers' ``forward_exact``) use it: the
            forward that streaming reproduces. Other layers are unchanged.

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
        if T > self.block and self.positions == "learned":
            raise ValueError(f"sequence length {T} exceeds the model's block size {self.block}")
        x = self.dropout(self._embed(idx, 0))
        options = self._attn_options(self._ntk_factor(T))
        for block in self.blocks:
            if exact and hasattr(block.attn, "forward_exact"):
                x = x + block.dropout(block.attn.forward_exact(block.ln_1(x)))
                x = x + block.mlp(block.ln_2(x))
            else:
                x = block(x, options)
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
        if positions or self.pos_emb is None:
            return total
        return total - self.pos_emb.weight.numel()

    # ------------------------------------------------------------------ helpers
    def _embed(self, idx, start):
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(start, start + idx.shape[1], device=idx.device))
        return x

    def _ntk_factor(self, length):
        return max(1.0, length / self.block) if self.ntk else 1.0

    @staticmethod
    def _attn_options(ntk_factor):
        # only rotary layers take the keyword; the SV layers' streaming calls do not
        return {} if ntk_factor == 1.0 else {"ntk_factor": ntk_factor}

    @staticmethod
    def _check_idx(idx, ndim):
        shape = "(B,)" if ndim == 1 else "(B, T)"
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.ndim != ndim:
            desc = (f"{idx.dtype} tensor of shape {tuple(idx.shape)}"
                    if isinstance(idx, torch.Tensor) else type(idx).__name__)
            raise ValueError(f"idx must be an int64 tensor of shape {shape}; got {desc}")
        if 0 in idx.shape:
            raise ValueError(f"idx is empty (shape {tuple(idx.shape)}); pass at least one token")

    def _check_stream(self, idx, state, ndim):
        self._check_idx(idx, ndim)
        if state is None:
            state = self.init_state(idx.shape[0])
        if not isinstance(state, TinyLMState) or len(state.layers) != len(self.blocks):
            raise TypeError("state must be a TinyLMState of this model (from init_state)")
        if state.batch != idx.shape[0]:
            raise ValueError(f"state holds {state.batch} sequences; idx has {idx.shape[0]}")
        length = 1 if ndim == 1 else idx.shape[1]
        if self.positions == "learned" and state.position + length > self.block:
            raise ValueError(f"learned positions end at the block size {self.block}; the "
                             f"stream would reach {state.position + length}")
        return state

    # ------------------------------------------------------------------ streaming
    def init_state(self, batch, *, max_length=None, sv_budget=None):
        """An empty streaming state for ``batch`` sequences.

        Parameters
        ----------
        batch : int
        max_length : int, optional
            Length the stream will reach. With ``ntk=True`` and ``max_length > block`` the
            stream uses NTK-aware scaling by ``max_length / block`` from its first token on
            (the same factor as ``forward`` over ``max_length`` tokens). With learned positions
            it may not exceed ``block``.
        sv_budget : int, optional
            Budget of the SV layers' exact streams (admitted keys per sequence and head above
            which certified reserve keys are evicted; ``CausalSVAttention.init_state``). Other
            layers have no budget; the model must have SV layers.

        Returns
        -------
        TinyLMState
        """
        check_int(batch, "batch", min=1)
        factor = 1.0
        if max_length is not None:
            check_int(max_length, "max_length", min=1)
            if self.positions == "learned" and max_length > self.block:
                raise ValueError(f"max_length {max_length} exceeds the block size {self.block} "
                                 "of learned positions")
            factor = self._ntk_factor(max_length)
        layers = [None] * len(self.blocks)
        if sv_budget is not None:
            from .layers import CausalSVAttention

            held = [i for i, b in enumerate(self.blocks) if isinstance(b.attn, CausalSVAttention)]
            if not held:
                raise ValueError("sv_budget needs SV layers; this model has none")
            for i in held:
                layers[i] = self.blocks[i].attn.init_state(batch, budget=sv_budget)
        return TinyLMState(layers=layers, position=0, batch=batch, ntk_factor=factor)

    @torch.no_grad()
    def forward_with_state(self, idx, state=None):
        """Continue the sequences of ``state`` with a chunk of tokens (inference, no autograd).

        Parameters
        ----------
        idx : LongTensor of shape (B, T)
        state : TinyLMState, optional
            From :meth:`init_state` (a fresh one when None). Updated in place.

        Returns
        -------
        logits : Tensor of shape (B, T, vocab)
            Equal to the rows of ``forward`` over the whole sequence so far (to rounding).
        state : TinyLMState
        """
        state = self._check_stream(idx, state, 2)
        x = self._embed(idx, state.position)
        options = self._attn_options(state.ntk_factor)
        for i, block in enumerate(self.blocks):
            x, state.layers[i] = block.forward_with_state(x, state.layers[i], options)
        state.position += idx.shape[1]
        return self.head(self.ln_f(x)), state

    @torch.no_grad()
    def step(self, idx_t, state=None):
        """One token per sequence through every layer's ``step`` (inference, no autograd).

        Parameters
        ----------
        idx_t : LongTensor of shape (B,)
        state : TinyLMState, optional
            Updated in place.

        Returns
        -------
        logits : Tensor of shape (B, vocab)
        state : TinyLMState
        """
        state = self._check_stream(idx_t, state, 1)
        x = self._embed(idx_t[:, None], state.position)[:, 0]
        options = self._attn_options(state.ntk_factor)
        for i, block in enumerate(self.blocks):
            x, state.layers[i] = block.step(x, state.layers[i], options)
        state.position += 1
        return self.head(self.ln_f(x)), state

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, *, temperature=1.0, top_k=None, generator=None):
        """Sample a continuation of ``idx`` through the streaming caches.

        The prompt is prefilled with :meth:`forward_with_state`, then every new token is drawn
        from the last logits and fed back with :meth:`step`. The model is in eval mode
        meanwhile (dropout off) and its mode is restored afterwards.

        Parameters
        ----------
        idx : LongTensor of shape (B, T0)
            Prompt, T0 >= 1.
        max_new_tokens : int
            Tokens to append (>= 0).
        temperature : float, default 1.0
            Logits are divided by it; 0 means greedy (arg-max) decoding.
        top_k : int, optional
            Keep only the k largest logits before sampling (1: greedy).
        generator : torch.Generator, optional
            Source of randomness (a fixed seed makes the output deterministic).

        Returns
        -------
        LongTensor of shape (B, T0 + max_new_tokens)
        """
        check_int(max_new_tokens, "max_new_tokens", min=0)
        check_real(temperature, "temperature", min=0.0)
        if top_k is not None:
            check_int(top_k, "top_k", min=1, max=self.vocab)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator; got "
                            f"{type(generator).__name__}")
        self._check_idx(idx, 2)
        total = idx.shape[1] + max_new_tokens
        if self.positions == "learned" and total > self.block:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds the block size "
                             f"{self.block} of learned positions")
        was_training = self.training
        self.eval()
        try:
            state = self.init_state(idx.shape[0], max_length=total)
            logits, state = self.forward_with_state(idx, state)
            last, out = logits[:, -1], [idx]
            for i in range(max_new_tokens):
                token = _sample(last, temperature, top_k, generator)
                out.append(token[:, None])
                if i + 1 < max_new_tokens:
                    last, state = self.step(token, state)
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)


def _sample(logits, temperature, top_k, generator):
    """Next tokens (B,) from logits (B, V): arg-max for temperature 0 or top_k 1."""
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.double() / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
