"""How tests/data/memory_v2.svtk and memory_v2_signed.svtk were made: run with the svtoolkit
of commit ffc1f19, the last whose ``save`` wrote the single-file format version 2 (today's
``save`` writes the store database, so this script no longer makes version-2 files).

    PYTHONPATH=<checkout of ffc1f19> python tests/data/make_memory_v2.py tests/data
"""
import sys
import numpy as np
from svtoolkit.memory import ForgettableMemory
KEY = b"version-2-fixture-key-32-bytes!!"
for key, name in [(None, "memory_v2.svtk"), (KEY, "memory_v2_signed.svtk")]:
    rng = np.random.default_rng(7)
    X = rng.standard_normal((24, 3))
    mem = ForgettableMemory(sigma=1.5, nu=0.25, n0=24, budget=20, metadata={"note": "version-2 test file"}, signing_key=key)
    for i, x in enumerate(X):
        mem.add(x, {"i": i, "text": f"value {i}"} if i % 3 else f"value {i}", record_id=f"k{i}")
    mem.forget("k23")
    mem.edit("k20", value=["edited", 6])
    mem.add([0.1, 0.2, 0.3], "Zoë", record_id="unicode-id-é")
    mem.save(sys.argv[1] + "/" + name)
    print(name, len(mem), mem.state_digest(), sorted(mem.tombstones))
