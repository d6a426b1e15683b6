"""``benchmarks/decode.py``: its measurement and table on one short length (no timing checked)."""

import pytest
from _scripts import load_benchmark

pytest.importorskip("torch")


def _module():
    return load_benchmark("decode")


def test_decode_rows_ratio_and_table():
    decode = _module()
    rows = decode.measure(["window_kv", "sv_hybrid"], (1,), n_tokens=32, runs=2)
    assert [(r["method"], r["L"]) for r in rows] == [("window_kv", 128), ("sv_hybrid", 128)]
    assert all(len(r["tok_s"]["runs"]) == 2 and r["tok_s"]["min"] <= r["tok_s"]["median"]
               <= r["tok_s"]["max"] for r in rows)
    assert rows[1]["sv_admitted_max"] > 0 and "sv_admitted_max" not in rows[0]
    (ratio,) = decode.ratios(rows).values()
    assert ratio == rows[0]["tok_s"]["median"] / rows[1]["tok_s"]["median"]
    table = decode.markdown(rows, 1, False)
    assert "| Window KV / SV hybrid |" in table and f"{ratio:.2f}x" in table
