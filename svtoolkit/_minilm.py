"""A NumPy forward of the all-MiniLM-L6-v2 sentence encoder (no torch).

The model is a BERT encoder (``config.json``: hidden size 384, 6 layers, 12 heads, erf GELU,
LayerNorm eps 1e-12, absolute positions) followed by the sentence-transformers modules listed
in ``modules.json`` (Transformer, Pooling, Normalize). Everything the forward needs is read
from the model directory: the tokeniser from ``tokenizer.json`` (the ``tokenizers`` library),
truncation from ``max_seq_length`` in ``sentence_bert_config.json``, the pooling mode from
``1_Pooling/config.json``, whether rows are L2-normalised from ``modules.json``, and the
weights (fp32) from ``model.safetensors`` through ``safetensors.numpy``.

The arithmetic is fp64 on the fp32 weights (each weight is exactly representable in fp64), so
its own rounding error is about 1e-15 and the difference from the sentence-transformers
encoder is that encoder's fp32 rounding (see ``tests/test_embeddings.py`` for the bound).
"""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["MiniLMEncoder"]

_BATCH = 32  # texts per forward at most


def _read_json(*parts):
    with open(os.path.join(*parts), encoding="utf-8") as fh:
        return json.load(fh)


def _batches(ids):
    """Index lists of texts to run together: sorted by length, at most ``_BATCH`` texts, and
    none longer than twice the batch's shortest (padding at most doubles the work)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = []
    for i in order:
        if batches and len(batches[-1]) < _BATCH and len(ids[i]) <= 2 * len(ids[batches[-1][0]]):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class MiniLMEncoder:
    """The BERT sentence encoder in a model directory, run in fp64 NumPy.

    Parameters
    ----------
    model_dir : str
        A sentence-transformers model directory (``config.json``, ``model.safetensors``,
        ``tokenizer.json``, ``sentence_bert_config.json``, ``modules.json``, ``1_Pooling/``).

    Raises
    ------
    ValueError
        The directory describes a model this forward does not implement (not BERT with erf
        GELU and absolute positions, or a pooling mode other than mean over the tokens).
    """

    def __init__(self, model_dir):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        config = _read_json(model_dir, "config.json")
        if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu" or \
                config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{model_dir}: expected a BERT encoder with erf GELU and absolute "
                             "positions (config.json)")
        modules = [m["type"].rsplit(".", 1)[-1] for m in _read_json(model_dir, "modules.json")]
        if modules[:2] != ["Transformer", "Pooling"] or \
                any(m != "Normalize" for m in modules[2:]):
            raise ValueError(f"{model_dir}: expected modules Transformer, Pooling[, Normalize]; "
                             f"got {modules}")
        pooling_dir = next(m["path"] for m in _read_json(model_dir, "modules.json")
                           if m["type"].endswith(".Pooling"))
        pooling = _read_json(model_dir, pooling_dir, "config.json")
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
        if modes != ["pooling_mode_mean_tokens"]:
            raise ValueError(f"{model_dir}: only mean pooling is implemented; got {modes}")
        sbert = _read_json(model_dir, "sentence_bert_config.json")

        self.normalize = "Normalize" in modules
        self.lowercase_input = bool(sbert.get("do_lower_case", False))
        self.max_seq_length = int(sbert["max_seq_length"])
        self.n_heads = int(config["num_attention_heads"])
        self.n_layers = int(config["num_hidden_layers"])
        self.eps = float(config["layer_norm_eps"])
        self.dim = int(config["hidden_size"])
        if int(pooling["word_embedding_dimension"]) != self.dim:
            raise ValueError(f"{model_dir}: pooling dimension {pooling['word_embedding_dimension']}"
                             f" differs from hidden_size {self.dim}")

        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        # tokenizer.json carries its own truncation/padding (128, fixed); the model truncates
        # at max_seq_length and pads each batch to its longest text.
        tok.enable_truncation(max_length=self.max_seq_length)
        tok.no_padding()
        self._tokenizer = tok

        w = load_file(os.path.join(model_dir, "model.safetensors"))
        # The word table stays fp32 (47 MB); its gathered rows become fp64 exactly.
        self._word = w["embeddings.word_embeddings.weight"]
        def f64(name):
            return w[name].astype(np.float64)

        def linear(name):  # (weight transposed to (in, out), bias)
            return f64(name + ".weight").T.copy(), f64(name + ".bias")

        def norm(name):
            return f64(name + ".weight"), f64(name + ".bias")

        self._pos = f64("embeddings.position_embeddings.weight")
        self._type0 = f64("embeddings.token_type_embeddings.weight")[0]
        self._ln0 = norm("embeddings.LayerNorm")
        self._layers = []
        for i in range(self.n_layers):
            p = f"encoder.layer.{i}."
            q, k, v = (linear(f"{p}attention.self.{n}") for n in ("query", "key", "value"))
            qkv = (np.concatenate([q[0], k[0], v[0]], axis=1), np.concatenate([q[1], k[1], v[1]]))
            self._layers.append((qkv, linear(p + "attention.output.dense"),
                                 norm(p + "attention.output.LayerNorm"),
                                 linear(p + "intermediate.dense"), linear(p + "output.dense"),
                                 norm(p + "output.LayerNorm")))
        from scipy.special import erf

        self._erf = erf

    def token_ids(self, texts):
        """Token ids of each text, as the model sees them.

        Parameters
        ----------
        texts : list of str

        Returns
        -------
        list of list of int
            ``[CLS] ... [SEP]`` ids, at most ``max_seq_length`` each.
        """
        texts = [t.strip() for t in texts]  # sentence-transformers strips each text
        if self.lowercase_input:
            texts = [t.lower() for t in texts]
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def encode(self, texts):
        """Embed texts.

        Parameters
        ----------
        texts : list of str

        Returns
        -------
        ndarray of shape (n, dim), float64
            Mean-pooled final hidden states, L2-normalised when ``modules.json`` says so.
        """
        ids = self.token_ids(texts)
        out = np.zeros((len(ids), self.dim))
        for chunk in _batches(ids):
            out[chunk] = self._forward([ids[i] for i in chunk])
        if self.normalize:
            out /= np.linalg.norm(out, axis=1, keepdims=True)
        return out

    def _layer_norm(self, x, gamma_beta):
        gamma, beta = gamma_beta
        mean = x.mean(axis=-1, keepdims=True)
        centred = x - mean
        var = (centred * centred).mean(axis=-1, keepdims=True)
        return centred / np.sqrt(var + self.eps) * gamma + beta

    def _forward(self, batch):
        """Mean-pooled hidden states of a batch of token-id lists; (n, dim) float64."""
        n, length = len(batch), max(len(b) for b in batch)
        ids = np.zeros((n, length), dtype=np.int64)
        mask = np.zeros((n, length), dtype=bool)
        for i, b in enumerate(batch):
            ids[i, :len(b)] = b
            mask[i, :len(b)] = True
        x = self._word[ids].astype(np.float64) + self._pos[:length] + self._type0
        x = self._layer_norm(x, self._ln0)
        h, d = self.n_heads, self.dim // self.n_heads
        key_mask = mask[:, None, None, :]  # (n, 1, 1, L): padded keys get zero weight
        scale = 1.0 / np.sqrt(d)
        for qkv, attn_out, ln1, ff_in, ff_out, ln2 in self._layers:
            proj = x @ qkv[0] + qkv[1]  # (n, L, 3 * dim)
            q, k, v = (proj[..., j * self.dim:(j + 1) * self.dim]
                       .reshape(n, length, h, d).transpose(0, 2, 1, 3) for j in range(3))
            scores = np.where(key_mask, (q @ k.transpose(0, 1, 3, 2)) * scale, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            context = (weights @ v).transpose(0, 2, 1, 3).reshape(n, length, self.dim)
            x = self._layer_norm(x + context @ attn_out[0] + attn_out[1], ln1)
            inner = x @ ff_in[0] + ff_in[1]
            inner = 0.5 * inner * (1.0 + self._erf(inner / np.sqrt(2.0)))  # erf GELU
            x = self._layer_norm(x + inner @ ff_out[0] + ff_out[1], ln2)
        weight = mask[..., None].astype(np.float64)
        return (x * weight).sum(axis=1) / weight.sum(axis=1)
